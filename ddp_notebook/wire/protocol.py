"""What the notebook and its ranks say to each other: message kinds, metric records, metrics files.

Messages on the channel are ``(kind, body)`` tuples of plain dicts; every body
that concerns a task carries its ``task`` id.  Both sides name the kinds from
here.  A job hands each message on to its listeners, together with the three
events it adds itself (``STARTED``, ``EXITED``, ``ENDED``).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

# The notebook to a rank
RUN = "run"  # {task, data | path, seed, attempt, every_rank[, debug][, profile]}: load the task (pickled in data, or in the file at path) and run it (attempt: 0, then 1, 2, ... after restarts; every_rank: False when it runs on some ranks only; debug: a failing rank waits at its failure for DEBUG or EXIT; profile: --profile's {steps, skip, clock_ns, host}, rank/profiling.py)
SYNC = "sync"  # {task, timeout, check_timeout}: a warm pool's barrier and process-group check after an interrupt
EXIT = "exit"  # {}: leave cleanly
STOP = "stop"  # {task}: stop gracefully at the next batch boundary (the rank reads it there)
ANSWER = "answer"  # {task, id, text | eof | refused}: the answer to a rank's PROMPT id (refused: why no one can answer it)
DEBUG = "debug"  # {task}: a rank kept at its failure (RUN's debug) opens the debugger post mortem there
WHERE = "where"  # {collectives, stack}: job.why()/stacks() asks a rank that runs an export (a Slurm task, a rank of another host), which reads its channel on a thread of its own, for what it can tell; answered with HERE

# A rank to the notebook
HELLO = "hello"  # {rank, pid[, node, host]}: the first message on a connection
READY = "ready"  # {}: the process group is up
RESULT = "result"  # {task, value[, stopped]}: (stopped: where a graceful stop ended it, {epoch, batch} or {step}) the pickled return value (rank side: payload.dumps_result)
FAILED = "failed"  # {task, etype, message, traceback, time, kind}: see errors.Failure
METRIC = "metric"  # {reports: [record or run, ...]}: report() calls, batched (pack_reports, expand_reports)
PROGRESS = "progress"  # {done, total}: progress() within an epoch
DISPLAY = "display"  # {data, metadata}: display() or plt.show() in a rank: one display bundle (rank/display.py)
SYNCED = "synced"  # {task, stage}: answer to SYNC, once past the store ("store") and the group check ("group")
BYE = "bye"  # {}: the rank is leaving
FILES = "files"  # {reason}: not every rank reached the notebook; they all report through the run's files instead
STOPPABLE = "stoppable"  # {task}: the task checks for a graceful stop (distributed_loader, should_stop())
PROFILE = "profile"  # {task, offset_ns, trace}: --profile: the rank's Chrome trace of its profiled steps (gzip JSON; None: no step reached the window), offset_ns: its wall clock's offset to the notebook's
RESUMED = "resumed"  # {task, epoch}: resume() found a checkpoint; the loop starts at this epoch
SAVING = "saving"  # {task, path, blocked_s, written_s, error}: rank 0's checkpoint written in the background: started (written_s None), written, or failed (error: its message)
PROMPT = "prompt"  # {task, id, prompt, said, debugger, group_timeout}: the rank waits for a line typed in the notebook (input(), pdb); said: what its debugger wrote since its last prompt, shown whatever --output; debugger: its debugger's prompt (the notebook asks this rank alone until SAID); group_timeout: the process group's, in seconds, or None
SAID = "said"  # {task, text}: the rank's debugger lets it go on; text: what it wrote since its last prompt (shown whatever --output)
DEBUGGED = "debugged"  # {task}: the debugger opened after a failure (DEBUG) has ended; the rank waits for EXIT
HERE = "here"  # {time[, collectives][, stack][, error]}: the answer to WHERE: the Flight Recorder's entries (rank/collectives.entries), every thread's Python stack (faulthandler's text)

# What a job adds for its listeners
STARTED = "started"  # {world_size, port, pids}
EXITED = "exited"  # {code}: a rank's process ended (code None: on another host)
ENDED = "ended"  # {ok}
SCHEDULER = "scheduler"  # {scheduler, job, state, reason, since[, mode, why]}: a scheduled job's place in its queue
STOPPING = "stopping"  # {by, grace}: a graceful stop was asked; the ranks stop at the next batch boundary
HANG = "hang"  # {text}: no progress for hang_after seconds; why (engine/hangs.py)
RESTARTED = "restarted"  # {attempt, attempts, cause, failure}: an attempt failed; the task runs again on fresh ranks

# Metric records: what report() sends, reduced over ranks in the notebook.
X_KEYS = ("epoch", "step")
TOTAL_KEYS = {"epoch": "epochs", "step": "steps"}
META_KEYS = frozenset(("epoch", "step", "epochs", "steps", "partial"))  # where a record sits, not what it measured

# A METRIC: {reports[, rank_stats]}, rank_stats where the rank's time went since its last METRIC (rank/timing.py).
# Its reports: each a record {key, x, values[, total, n, sum, epoch, went_back]} (went_back: the user's last x and
# this one, where the rank counted on past a key that went back), or a run of records that
# carry key, x, values and total alone, with the same key, metric names (in one order) and total, one after the
# other: (RUN, key, total, names, xs, columns), columns[j][i] the value of names[j] at xs[i].  A rank reporting every
# step sends a few runs a second: a list of numbers a metric is a fraction of a dict a report to pickle and read.
RUN = "run"
_RUN_FIELDS = frozenset(("key", "x", "values", "total"))


def pack_reports(reports: list[dict]) -> list:
    """The reports as a METRIC carries them: runs where they follow one another alike, records elsewhere."""
    packed: list = []
    run: tuple | None = None  # the open run, and the record it began with (a run of one goes as that record)
    first: dict | None = None
    alike: tuple | None = None  # (key, total, names) of the open run
    for report in reports:
        shape = None
        if report.keys() <= _RUN_FIELDS and report["values"]:
            values = report["values"]
            shape = (report["key"], report.get("total"), tuple(values))
            if shape == alike:
                run[4].append(report["x"])
                for column, value in zip(run[5], values.values()):
                    column.append(value)
                continue
        if run is not None and len(run[4]) == 1:
            packed[-1] = first
        if shape is None:
            run = first = alike = None
            packed.append(report)
        else:
            run, first, alike = (RUN, *shape, [report["x"]], [[value] for value in values.values()]), report, shape
            packed.append(run)
    if run is not None and len(run[4]) == 1:
        packed[-1] = first
    return packed


def expand_reports(items) -> Iterator[dict]:
    """A METRIC's reports one record at a time, runs unpacked."""
    for item in items:
        if type(item) is tuple and item[0] == RUN:
            _, key, total, names, xs, columns = item
            for i, x in enumerate(xs):
                record = {"key": key, "x": x, "values": {name: column[i] for name, column in zip(names, columns)}}
                if total is not None:
                    record["total"] = total
                yield record
        else:
            yield item


# Exported runs write their events to one JSON-lines file per node: records {"event": ..., "time", "run", "node",
# "rank", ...}, read back by follow().  READY, METRIC, PROGRESS and FAILED carry the fields of the messages above.
METRICS_PREFIX, METRICS_SUFFIX = "metrics-node", ".jsonl"
FILE_START = "start"  # {world_size, ...}: the first record of a node
FILE_EXIT = "exit"  # {rank[, lost]}: a rank left (lost: its connection broke)
FILE_END = "end"  # {ok}: the node's last record
# (HERE, {rank, collectives, stack[, error]}: a rank whose collectives stood still wrote where it is: follow()'s run.why())
FILE_RESULT = "result"  # {rank, file, sha256}: the rank's pickled return value is in that file of the run directory
RECORD_MAC = "mac"  # a record of a run with a notebook's key (a Slurm job's): HMAC-SHA256 of the rest, by that key
RUN_DIR_ENV = "DDP_NOTEBOOK_RUN_DIR"
STILL_AFTER_ENV = "DDP_NOTEBOOK_STILL_AFTER_S"  # an export reporting through files: how long a rank's collectives stay still before it writes where it is (a HERE record; default 10 s)
FLIGHT_RECORDER_ENTRIES = "2000"  # TORCH_FR_BUFFER_SIZE where the user's environment does not set it (job.why())
SLURM_RUN_SUFFIX = "_ddp_notebook"  # a Slurm job's run directory: <job folder>/<job id>_ddp_notebook


def stacks_path(job_dir: str, rank: int) -> str:
    """Where a rank's faulthandler writes its Python stacks on SIGUSR1 (``job.stacks()``)."""
    return os.path.join(job_dir, f"stacks-rank{rank}.txt")


def collectives_path(job_dir: str, rank: int) -> str:
    """Where a rank writes its Flight Recorder's collectives (JSON) when asked (``job.why()``)."""
    return os.path.join(job_dir, f"collectives-rank{rank}.json")


def collectives_request_path(job_dir: str, rank: int) -> str:
    """The FIFO the notebook writes a byte into to ask a rank for its collectives (``collectives_path``)."""
    return os.path.join(job_dir, f"collectives-rank{rank}.fifo")


def metrics_path(run_dir: str, node: int) -> str:
    """The metrics file of node ``node`` of an exported run."""
    return os.path.join(run_dir, f"{METRICS_PREFIX}{node}{METRICS_SUFFIX}")


def result_name(rank: int) -> str:
    """The file (in the run directory) that holds a rank's pickled return value, for runs that keep them."""
    return f"result-rank{rank}.pkl"


def signed_record(record: dict, key: bytes) -> dict:
    """``record`` with its MAC by the job's ``key``, as a run file carries it."""
    return {**record, RECORD_MAC: _record_mac(record, key)}


def verified_record(record: dict, key: bytes) -> dict | None:
    """``record`` without its MAC when the MAC is the job's ``key``'s; None for a record anyone else wrote."""
    mac = record.get(RECORD_MAC)
    body = {k: v for k, v in record.items() if k != RECORD_MAC}
    return body if isinstance(mac, str) and hmac.compare_digest(mac, _record_mac(body, key)) else None


def _record_mac(record: dict, key: bytes) -> str:
    # A key of its own for run files (the channel's handshake uses the job's key itself), over a canonical form.
    text = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(hmac.new(key, b"ddp_notebook run files", hashlib.sha256).digest(), text, hashlib.sha256).hexdigest()


def slurm_run_dir(job_folder: str, job_id: str) -> str:
    """Where the ranks of a Slurm job write their metrics and results when they cannot reach the notebook."""
    return os.path.join(job_folder, f"{job_id}{SLURM_RUN_SUFFIX}")


def format_number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_record(record: dict, suffix: str = "") -> str:
    """One compact line: ``epoch 3/10  train_loss 0.4123  val_acc 0.931``."""
    parts = []
    for key in X_KEYS:
        if key in record:
            total = record.get(TOTAL_KEYS[key])
            parts.append(f"{key} {format_number(record[key])}" + (f"/{total}" if total is not None else ""))
    for name, value in record.items():
        if name not in META_KEYS:
            parts.append(f"{name} {format_number(value)}")
    if record.get("partial"):
        parts.append(f"(partial: {record['partial']})")
    line = "  ".join(parts)
    return f"{line}  {suffix}" if suffix else line


@dataclass(frozen=True)
class RankStart:
    """What a rank of this host is started with (``engine/local.py`` → ``rank/worker.py``): as JSON on a fresh rank's
    stdin, or in the rank template's fork request.  Its environment carries the torchrun contract besides."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    address: tuple  # the notebook's channel: (host, port)
    key: str  # the channel's key, hex
    parent_pid: int  # the notebook's process: a fresh rank whose parent is another refuses to start
    sys_path: list  # the notebook's, with "" as its working folder
    gpus: bool  # the rank sets its CUDA device (its local rank's)
    backend: str
    init_group: bool  # False: spawn(), the user's code makes the process group
    user_picks_gpu: bool  # spawn() on GPUs: the user's code picks its GPU, as under mp.spawn
    master_addr: str
    master_port: int | None
    timeout: float | None  # per collective (--timeout)
    startup_timeout: float
    job_dir: str | None  # the job's 0700 folder: stacks, Flight Recorder requests
    libraries: dict | None  # the notebook's libraries found where the rank would not find them (rank/worker.py)
    store_file: str | None = None  # the FileStore the ranks meet in, in the job's folder (else a TCPStore)
    store_fd: int | None = None  # rank 0 of a TCPStore: the listening socket the notebook bound for it

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "RankStart":
        return cls(**{**data, "address": tuple(data["address"])})
