"""Why a job is stuck (``job.why()``, ``%ddp_why``, and said by itself after ``--hang-after`` seconds of no
progress): which ranks wait in which collective, which rank has not joined it and where that rank is, which ranks
finished their task, and which called a different collective than the others.

Each rank's collectives come from torch's Flight Recorder, read by a thread of the rank on request
(``rank/collectives.py``: a byte written into its FIFO in the job's directory, the entries written back as JSON;
an export's rank, a Slurm task or a rank of another host, is asked over the channel: ``RankBackend.where``);
where each rank is comes from its stack (``stacks.collect``), shown at the cell's own line with the line's code.
"""
from __future__ import annotations

import datetime
import json
import linecache
import os
import time
from dataclasses import dataclass, field

from ..wire import payload, protocol
from . import stacks

DEFAULT_HANG_AFTER = 180.0  # seconds without progress before a running job says why it is stuck


def ask(group, ranks: list[int], wait: float = 2.0) -> dict[int, list[dict] | None]:
    """Each rank's Flight Recorder entries (oldest first), or None where the rank did not answer within ``wait``:
    through the job's folder from the ranks of this host, over the channel from an export's (``group.where``)."""
    found: dict[int, list[dict] | None] = {rank: None for rank in ranks}
    workdir = group.workdir
    asked = {}
    for rank in ranks if workdir is not None else ():
        if rank not in group.alive:
            continue
        try:
            fd = os.open(protocol.collectives_request_path(workdir, rank), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no FIFO, or no thread reading it (ENXIO)
            continue
        try:
            os.write(fd, b"?")
        finally:
            os.close(fd)
        asked[rank] = time.time()
    deadline = time.monotonic() + wait
    while asked and time.monotonic() < deadline:
        for rank, since in list(asked.items()):
            try:
                with open(protocol.collectives_path(workdir, rank)) as handle:
                    body = json.load(handle)
            except (OSError, ValueError):
                continue
            if body.get("time", 0) >= since - 0.01:  # (a file written for an earlier request is older)
                found[rank] = body.get("entries", [])
                del asked[rank]
        time.sleep(0.02)
    rest = [rank for rank, entries in found.items() if entries is None]  # (where() knows which it can ask: the
    if rest:  # ranks of other hosts are in no alive list here)
        for rank, body in group.where(rest, wait, collectives=True, stack=False).items():
            found[rank] = body.get("collectives", [])
    return found


def _since(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + (", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}")


def _call(entry: dict) -> str:
    return f"{entry['name']} #{entry['seq']}"


def _sizes(entry: dict) -> str:
    return "×".join(str(s) for s in entry["sizes"][0]) if entry.get("sizes") and entry["sizes"][0] else "-"


@dataclass
class Diagnosis:
    """What ``job.why()`` found: the text, and the same in parts."""

    text: str
    waiting: dict[int, dict] = field(default_factory=dict)  # rank -> the collective it waits in (oldest pending)
    missing: list[int] = field(default_factory=list)  # running ranks that have not reached that collective
    finished: list[int] = field(default_factory=list)  # ranks whose task has ended
    mismatched: dict[int, str] = field(default_factory=dict)  # rank -> what it called where others called another
    newest: float | None = None  # when the newest collective of any rank was made (time.time())
    at: str = ""  # when it was found (local time)

    def __str__(self) -> str:
        return self.text

    @property
    def key(self) -> tuple:
        """What it says, without times and stacks: a hang said again only when this changes."""
        return (tuple(sorted((r, e["group"], e["seq"], e["name"]) for r, e in self.waiting.items())),
                tuple(self.missing), tuple(self.finished), tuple(sorted(self.mismatched.items())))

    __repr__ = __str__


def _line_of(path: str, line: int) -> str:
    """The code at a line: of a cell as its user wrote it (linecache holds IPython's transformed ``%%ddp`` cell),
    or of a file."""
    text = payload.notebook_sources({path}).texts.get(path)
    if text is not None:
        lines = text.splitlines()
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""
    return linecache.getline(path, line).strip()


def _where(where: stacks.RankStacks, rank: int) -> str:
    """Where a rank is: its innermost user frame at the cell's own line, with that line's code."""
    frames = where.frames.get(rank)
    if not frames:
        return where.where(rank)
    files = {label: path for path, label in where.labels.items()}
    for frame in frames:
        if frame.file.startswith(stacks.LIBRARY_DIRS):
            continue
        code = _line_of(files.get(frame.file, frame.file), frame.line)
        place = f"cell line {frame.line}" if frame.file.startswith("Cell In[") else str(frame)
        return f"{place}, `{code}`" if code else place
    return where.where(rank)


NO_ANSWER = "no Flight Recorder answer; not a ddp_notebook rank of this notebook, or not running"


def diagnose(group, ranks: list[int], finished: list[int], wait: float = 2.0, no_answer: str = NO_ANSWER) -> Diagnosis:
    """Ask the running ranks of ``ranks`` for their collectives and stacks; say why they are stuck (``no_answer``:
    what is said of a rank that did not answer)."""
    running = [r for r in ranks if r not in finished]
    recorded = ask(group, running, wait)
    where = stacks.collect(group, running, wait)
    now = time.time()
    pending = {}
    newest = None
    for rank, entries in recorded.items():
        if entries:
            newest = max(newest or 0.0, max(e["created"] for e in entries))
        open_calls = [e for e in entries or () if not e["done"]]
        if open_calls:
            pending[rank] = min(open_calls, key=lambda e: (e["group"], e["seq"]))
    lines = []
    missing: list[int] = []
    mismatched: dict[int, str] = {}
    if pending:
        target = min(pending.values(), key=lambda e: (e["group"], e["seq"]))
        at = {r: e for r, e in pending.items() if (e["group"], e["seq"]) == (target["group"], target["seq"])}
        kinds: dict[tuple, list[int]] = {}
        for rank, entry in at.items():
            kinds.setdefault((entry["name"], _sizes(entry)), []).append(rank)
        common = max(kinds, key=lambda k: (len(kinds[k]), -min(kinds[k])))
        group_note = "" if target["group"] == "0" else f" of process group {target['group']}"
        since = min(at[r]["created"] for r in kinds[common])
        verb = "waits" if len(kinds[common]) == 1 else "wait"
        lines.append(f"{_ranks(kinds[common])} {verb} in {common[0]} #{target['seq']}{group_note} since "
                     f"{_since(now - since)}")
        for (name, sizes), who in kinds.items():
            if (name, sizes) == common:
                continue
            for rank in who:
                mismatched[rank] = f"{name} #{target['seq']} (size {sizes})"
            lines.append(f"{_ranks(who)} called {name} #{target['seq']} (size {sizes}) where "
                         f"{_ranks(kinds[common])} called {common[0]} (size {common[1]}): the collectives disagree")
        for rank in running:
            if rank in at:
                continue
            missing.append(rank)
            entries = recorded.get(rank)
            last = max((e["seq"] for e in entries if e["group"] == target["group"]), default=0) if entries else None
            done = f" (its last was #{last})" if last else ""
            lines.append(f"{_ranks([rank])} has not reached it{done}: it is at {_where(where, rank)}")
    else:
        lines.append("no rank waits in a collective" if any(recorded.values()) or recorded else
                     "no rank runs")
        for rank in running:
            lines.append(f"{_ranks([rank])} is at {_where(where, rank)}")
    if finished:
        lines.append(f"{_ranks(finished)} finished {'its' if len(finished) == 1 else 'their'} task already")
    unanswered = [r for r in running if recorded.get(r) is None]
    if unanswered:
        lines.append(f"({_ranks(unanswered)}: {no_answer})")
    return Diagnosis("\n".join(lines), dict(pending), missing, sorted(finished), mismatched, newest,
                     time.strftime("%H:%M:%S"))


class HangWatch:
    """When a running job last made progress, and whether it has been told stuck since (``hang_after`` seconds
    without a message from a rank nor a new collective; None: never)."""

    def __init__(self, hang_after: float | None):
        self.hang_after = hang_after
        self.last = time.monotonic()
        self.told: tuple | None = None  # the key of the diagnosis said for this hang

    def progress(self) -> None:
        """A rank said something: the job moves."""
        self.last = time.monotonic()
        self.told = None

    def check(self, diagnose_now) -> Diagnosis | None:
        """The diagnosis (``diagnose_now()``) once ``hang_after`` seconds passed without progress, said once per
        hang, and again every ``hang_after`` seconds where what it says changed; None while the job moves (a
        collective made within ``hang_after`` counts as progress)."""
        if self.hang_after is None or time.monotonic() - self.last < self.hang_after:
            return None
        found = diagnose_now()
        if found.newest is not None and time.time() - found.newest < self.hang_after:
            self.last = time.monotonic() - (time.time() - found.newest)
            self.told = None
            return None
        self.last = time.monotonic()  # (looked again after hang_after more seconds)
        if found.key == self.told:
            return None
        self.told = found.key
        return found
