"""Notebook side of ``%%ddp --profile``: the ranks' traces merged into one file, and where each rank's time went.

Each rank sends the Chrome trace of its profiled steps (``rank/profiling.py``,
a ``PROFILE`` message).  As the job ends they become one Chrome/Perfetto trace
(one process per rank, ``pid`` = rank, named "rank N", every timestamp on the
notebook's clock), written where the job's files go, and a breakdown per rank:

- ``data``: the loader's wait for the next batch (the ``ddp_notebook:data`` ranges);
- ``compute``: time in the profiled ops (CPU ops, and GPU kernels where there are)
  outside the data wait and outside collectives;
- ``communication``: time in collectives (gloo's ``gloo:*``, NCCL's kernels,
  ``c10d::`` ops) that no computation overlapped: the rank waited for the others;
- ``idle``: the rest of the window (Python between ops, waits that are none of these).

Holistic Trace Analysis computes this from GPU kernels and streams; on CPU-only
gloo traces it has none to work from (docs/metrics-and-dashboard.md), so the
breakdown is computed here from the trace events.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import socket
import time
from typing import Any, Iterable

from ..wire import protocol, safe_files
from ..wire.errors import LaunchError

DEFAULT_STEPS = 10
DEFAULT_SKIP = 5
DATA_RANGE = "ddp_notebook:data"
CATEGORIES = ("compute", "communication", "data", "idle")
_COLLECTIVE = re.compile(r"^(gloo:|nccl:|c10d::|ncclDevKernel|ncclKernel)|allreduce|all_reduce|allgather|all_gather|"
                         r"reduce_scatter|broadcast|barrier", re.IGNORECASE)
_STRAGGLER_MARGIN = 0.1  # a straggler's wait for the others is this share of the step below theirs, at least


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    """What ``--profile`` asked: record ``steps`` steps after leaving out ``skip`` (warm-up)."""

    steps: int = DEFAULT_STEPS
    skip: int = DEFAULT_SKIP

    @classmethod
    def parse(cls, spec: Any) -> "ProfileOptions | None":
        """``True``/``""`` (the defaults), ``"steps=20,skip=5"``, a dict, or None/False (no profiling)."""
        if spec is None or spec is False:
            return None
        if isinstance(spec, ProfileOptions):
            return spec
        if spec is True or spec == "":
            return cls()
        if isinstance(spec, str):
            items = {}
            for part in spec.split(","):
                name, eq, value = part.strip().partition("=")
                if not eq:
                    raise LaunchError(f"--profile {spec}: give steps=N,skip=M (each optional)")
                items[name.strip()] = value.strip()
            spec = items
        if not isinstance(spec, dict):
            raise LaunchError(f"profile takes True, 'steps=N,skip=M' or a dict, not {spec!r}")
        unknown = set(spec) - {"steps", "skip"}
        if unknown:
            raise LaunchError(f"profile: unknown {', '.join(sorted(unknown))} (it takes steps and skip)")
        values = {}
        for name, value in spec.items():
            try:
                values[name] = int(value)
            except (TypeError, ValueError):
                raise LaunchError(f"profile: {name} must be a whole number, not {value!r}") from None
        options = cls(**values)
        if options.steps < 1 or options.skip < 0:
            raise LaunchError(f"profile: steps must be 1 or more and skip 0 or more, not {options}")
        return options

    def for_ranks(self) -> dict:
        """``RUN``'s ``profile``: the window, and the notebook's clock and host to align the ranks' traces."""
        return {"steps": self.steps, "skip": self.skip, "clock_ns": time.time_ns(), "host": socket.gethostname()}


@dataclasses.dataclass(frozen=True)
class Profile:
    """A profiled job's findings (``last_job().profile``).

    ``trace``: the merged Chrome/Perfetto trace (a path; None when no rank sent one);
    ``summary``: rank -> seconds in ``compute``, ``communication``, ``data``, ``idle`` over its profiled steps;
    ``straggler``: the rank the others waited for, or None; ``why``: what it did meanwhile, in words;
    ``overlap``: rank -> the share of its collective time that computation overlapped (None: no collective);
    ``steps``: rank -> how many steps its window holds.
    """

    trace: str | None
    summary: dict[int, dict[str, float]]
    straggler: int | None
    why: str | None
    overlap: dict[int, float | None]
    steps: dict[int, int]

    def text(self) -> str:
        """A few lines for under the cell."""
        if not self.summary:
            return "profile: no rank reached its profiled steps (fewer steps than skip + 1?)"
        lines = []
        for rank, seconds in sorted(self.summary.items()):
            total = sum(seconds.values()) or 1.0
            parts = ", ".join(f"{name} {seconds[name]:.3f} s ({100 * seconds[name] / total:.0f} %)"
                              for name in CATEGORIES)
            overlap = self.overlap.get(rank)
            hidden = "" if overlap is None else f"; {100 * overlap:.0f} % of its communication overlapped compute"
            lines.append(f"rank {rank} ({self.steps.get(rank, 0)} steps): {parts}{hidden}")
        lines.append(f"straggler: {self.why}" if self.straggler is not None else
                     "straggler: none (no rank kept the others waiting noticeably)")
        if self.trace:
            lines.append(f"trace: {self.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
        return "\n".join(lines)


class Collector:
    """Listens to a job (``job.add_listener``); as it ends, merges its ranks' traces into :attr:`profile`."""

    def __init__(self, folder: str | None = None):
        self.folder = os.path.abspath(os.path.expanduser(folder)) if folder else os.getcwd()
        self.traces: dict[int, tuple[dict, int]] = {}  # rank -> (its Chrome trace, offset ns)
        self.profile: Profile | None = None  # once the job has ended

    def __call__(self, job, kind: str, rank: int, body: dict) -> None:
        if kind == protocol.PROFILE and body.get("trace"):
            try:
                self.traces[rank] = (json.loads(gzip.decompress(body["trace"])), int(body.get("offset_ns", 0)))
            except (OSError, ValueError) as exc:
                print(f"ddp_notebook: rank {rank}'s profile trace could not be read: {exc}")
        elif kind == protocol.STARTED or kind == protocol.RESTARTED:
            self.traces.clear()  # (a restart: only the last attempt's)
        elif kind == protocol.ENDED:
            try:
                self.profile = self.finish(f"ddp_profile_job{job.task_id}")
            except OSError as exc:
                print(f"ddp_notebook: the profile trace could not be written into {self.folder}: {exc}")

    def finish(self, name: str) -> Profile:
        """Merge the traces into ``<folder>/<name>-<time>.json.gz`` and break each rank's time down."""
        merged = merge(self.traces)
        path = None
        if merged["traceEvents"]:
            path = os.path.join(self.folder, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json.gz")
            with safe_files.replace_atomically(path) as f:
                with gzip.GzipFile(fileobj=f, mode="wb", compresslevel=5) as z:
                    z.write(json.dumps(merged).encode())
        return analyze(merged["traceEvents"], path)


def merge(traces: dict[int, tuple[dict, int]]) -> dict:
    """One Chrome trace of every rank's: ``pid`` = rank, a "rank N" process name, timestamps (µs) on the notebook's
    clock, from the earliest event of any rank.  A trace's ``ts`` counts from its ``baseTimeNanoseconds``."""
    shifts = {rank: trace.get("baseTimeNanoseconds", 0) / 1000 + offset_ns / 1000
              for rank, (trace, offset_ns) in traces.items()}
    starts = [shifts[rank] + e["ts"] for rank, (trace, _) in traces.items() for e in trace.get("traceEvents", ())
              if isinstance(e.get("ts"), (int, float)) and e.get("ph") == "X"]
    origin = min(starts) if starts else 0.0
    events: list[dict] = []
    for rank, (trace, _) in sorted(traces.items()):
        shift = shifts[rank] - origin
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for event in trace.get("traceEvents", ()):
            if event.get("ph") == "M" and event.get("name") in ("process_name", "process_sort_index",
                                                                "process_labels"):
                continue
            event = dict(event)
            if event.get("pid") not in (None, "Spans", "Traces"):
                event["tid"] = f"{event['pid']}:{event.get('tid')}" if _is_device(event) else event.get("tid")
            event["pid"] = rank
            if isinstance(event.get("ts"), (int, float)):
                event["ts"] = round(event["ts"] + shift, 3)
            events.append(event)
    return {"displayTimeUnit": "ms", "traceEvents": events,
            "otherData": {"ddp_notebook": "merged by ddp_notebook --profile; pid = rank, ts in µs from the "
                                          "earliest event on the notebook's clock"}}


def _is_device(event: dict) -> bool:
    return event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for start, end in a:
        for b_start, b_end in b:
            if b_end <= start or b_start >= end:
                continue
            if b_start > start:
                out.append((start, b_start))
            start = max(start, b_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def breakdown(events: list[dict]) -> tuple[dict[str, float], float | None, int]:
    """One rank's events: (seconds per category, the share of its communication that compute overlapped, steps)."""
    spans = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
             and isinstance(e.get("dur"), (int, float))]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in spans if str(e.get("name", "")).startswith("ProfilerStep#")]
    if steps:
        window = [(min(a for a, _ in steps), max(b for _, b in steps))]
    else:
        timed = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e.get("cat") in ("cpu_op", "user_annotation")]
        if not timed:
            return {name: 0.0 for name in CATEGORIES}, None, 0
        window = [(min(a for a, _ in timed), max(b for _, b in timed))]

    def clipped(selected) -> list[tuple[float, float]]:
        return _intersect(_union((e["ts"], e["ts"] + e["dur"]) for e in selected), window)

    data = clipped(e for e in spans if e.get("name") == DATA_RANGE)
    comm = clipped(e for e in spans if _COLLECTIVE.search(str(e.get("name", "")))
                   and (e.get("cat") in ("cpu_op", "user_annotation") or _is_device(e)))
    work = clipped(e for e in spans if (e.get("cat") == "cpu_op" or e.get("cat") == "kernel")
                   and not _COLLECTIVE.search(str(e.get("name", ""))))
    compute = _minus(_minus(work, data), comm)
    overlap = _length(_intersect(comm, _minus(work, data))) / _length(comm) if _length(comm) else None
    exposed_comm = _minus(_minus(comm, data), work)
    seconds = {"compute": _length(compute) / 1e6, "communication": _length(exposed_comm) / 1e6,
               "data": _length(data) / 1e6}
    seconds["idle"] = max(0.0, _length(window) / 1e6 - sum(seconds.values()))
    return seconds, overlap, len(steps)


def analyze(events: list[dict], trace: str | None) -> Profile:
    """The merged trace's breakdown per rank (``pid``), and the straggler: the rank that waited least in
    collectives while the others waited for it, with what it did instead."""
    by_rank: dict[int, list[dict]] = {}
    for event in events:
        if isinstance(event.get("pid"), int):
            by_rank.setdefault(event["pid"], []).append(event)
    summary, overlap, steps = {}, {}, {}
    for rank, rank_events in sorted(by_rank.items()):
        seconds, hidden, count = breakdown(rank_events)
        if not sum(seconds.values()):
            continue
        summary[rank], overlap[rank], steps[rank] = seconds, hidden, count
    straggler, why = find_straggler(summary)
    return Profile(trace, summary, straggler, why, overlap, steps)


def find_straggler(summary: dict[int, dict[str, float]]) -> tuple[int | None, str | None]:
    """The rank whose share of waiting in collectives is lowest, by a margin, while the others wait: the one they
    wait for; why: the category it spends most more time in than the others do."""
    if len(summary) < 2:
        return None, None
    shares = {rank: {name: s[name] / (sum(s.values()) or 1.0) for name in CATEGORIES} for rank, s in summary.items()}
    straggler = min(shares, key=lambda rank: shares[rank]["communication"])
    others = [r for r in shares if r != straggler]
    waited = sum(shares[r]["communication"] for r in others) / len(others)
    if waited - shares[straggler]["communication"] < _STRAGGLER_MARGIN:
        return None, None
    excess = {name: shares[straggler][name] - sum(shares[r][name] for r in others) / len(others)
              for name in ("compute", "data", "idle")}
    cause = max(excess, key=excess.get)
    doing = {"compute": "computing", "data": "waiting for data", "idle": "outside profiled ops (idle)"}[cause]
    return straggler, (f"rank {straggler}: {100 * shares[straggler][cause]:.0f} % of its step {doing}, while the "
                       f"others spent {100 * waited:.0f} % of theirs waiting for it in collectives")


def checked(spec: Any, *, nnodes: int = 1, executor: Any = None, detach: bool = False,
            export_only: bool = False) -> ProfileOptions | None:
    """``spec`` as options, refused where the notebook would not get the ranks' traces (before anything starts)."""
    options = ProfileOptions.parse(spec)
    if options is not None and (nnodes > 1 or executor is not None or detach or export_only):
        raise LaunchError("--profile covers the ranks of this host and the warm pool: not a job on several hosts, "
                          "a Slurm job or an export (run torch.profiler in the script there)")
    return options
