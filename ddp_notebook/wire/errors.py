"""Errors that cross from the ranks to the notebook, and how they are told."""
from __future__ import annotations

import enum
import os
import re
import traceback
from dataclasses import dataclass

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ddp_notebook/, above wire/

# A bystander's view of another rank's failure: its collective lost the peer.
_COMM_PATTERNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"connection reset|Socket closed|ECONNRESET|EPIPE|NCCL communicator was aborted|"
    r"Connection refused|ProcessGroup.*(aborted|shut ?down)",
    re.IGNORECASE,
)
_TIMEOUT_PATTERNS = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
# What ProcessGroupNCCL's watchdog logs (LOG(ERROR), on stderr) before it takes the process down with SIGABRT under
# torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (3: tear down without aborting the communicator; 1: with):
#   [rank0]:[E1218 20:27:21.426 ProcessGroupNCCL.cpp:629] [Rank 0] Watchdog caught collective operation timeout:
#   WorkNCCL(SeqNum=1, OpType=ALLREDUCE, ..., Timeout(ms)=600000) ran for 600081 milliseconds before timing out.
_NCCL_WATCHDOG = re.compile(r"(?:\[(?:PG [^\]]*)?Rank \d+\] )?Watchdog caught collective operation timeout:[^\n]*")

# What of a rank's error the notebook shows (Jupyter's server drops iopub data over 1 MB/s, front ends stall on
# huge outputs and saved notebooks keep them): its message's first and last 2,000 characters, and at most 20,000
# characters of its traceback.  The whole text stays on the error (``.failure``) and in the rank's log.
SHOWN_MESSAGE_CHARS = 4_000
SHOWN_TRACEBACK_CHARS = 20_000


def clipped(text: str, limit: int, whole: str) -> str:
    """``text`` as the notebook shows it: as it is up to ``limit`` characters, else its first and last
    ``limit // 2`` with a note between them of how many characters were cut and where the whole text is
    (``whole``: "rank 1's log, ...")."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return (f"{text[:half]} ...[ddp_notebook: {len(text) - 2 * half:,} characters cut here; the whole text is in "
            f"{whole}]... {text[len(text) - half:]}")


def clipped_lines(text: str, line_limit: int, limit: int, whole: str) -> str:
    """:func:`clipped` for a text of many lines (a traceback): each line over ``line_limit``, then the whole."""
    if len(text) <= line_limit:
        return text
    return clipped("\n".join(clipped(line, line_limit, whole) for line in text.split("\n")), limit, whole)


class DDPNotebookError(Exception):
    """Base of this package's own errors."""


class LaunchError(DDPNotebookError):
    """A job was refused before any rank started (bad flags, unpicklable name, ...)."""


class JobStopped(DDPNotebookError):
    """A background job was stopped (``job.stop()``, the dashboard's Stop button, ``%ddp_stop``) before it ended."""

    def __init__(self, job_id: int, by: str):
        self.job_id = job_id
        self.by = by
        super().__init__(f"job #{job_id} was stopped by {by} before it ended")

    def __reduce__(self):
        return type(self), (self.job_id, self.by)


class Stopped(KeyboardInterrupt):
    """A job run in the foreground was stopped gracefully (the first interrupt, or its dashboard's Stop): every
    rank ended at the same batch, and what it kept came back (``results``: ``launch()``'s per-rank values).  Like
    any interrupted cell it fails, so that the cells queued after it ("Run All") are not run; IPython shows it as
    one line, with no traceback."""

    def __init__(self, where: str, kept: str = "", results: list | None = None):
        super().__init__(f"ddp_notebook: {where}{kept}. The cells queued after this one are not run.")
        self.where = where  # "stopped at epoch 4, batch 17", "job #3 stopped at step 41"
        self.results = results

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead of a traceback
        return [str(self)]


class TrainingStopped(BaseException):
    """Raised in a rank by a loader iterated again after a graceful stop: the cell ends there, normally.

    A ``BaseException``, so that a cell's ``except Exception`` does not swallow it.
    """


class FailureKind(enum.StrEnum):
    """Why a rank failed; :func:`blame` puts the kinds that cause others first.  A string (the wire carries it so)."""

    USER = "user"  # the task raised
    STARTUP = "startup"  # the rank could not start, reach the notebook or join the process group in time
    EXIT = "exit"  # it died without a report
    TIMEOUT = "timeout"  # a collective timed out
    COMM = "comm"  # it lost a peer
    INTERRUPTED = "interrupted"  # it was interrupted (KeyboardInterrupt)
    DEBUGGER = "debugger"  # q, or the end of input, in its debugger


@dataclass
class Failure:
    """What one rank reported (or what its exit told) about why it failed."""

    rank: int
    etype: str
    message: str
    traceback: str
    time: float  # when the rank caught the error (time.time() on that rank)
    kind: FailureKind  # (a string from the wire is made one)

    def __post_init__(self):
        self.kind = FailureKind(self.kind)

    def headline(self) -> str:
        return f"{self.etype}: {self.message}" if self.message else self.etype


class RankError(DDPNotebookError, RuntimeError):
    """A rank failed; ``rank`` is the one that failed first, ``failures`` all reports.

    Its text (``str()``, :meth:`summary`, :meth:`shown_traceback`) shows a huge message or traceback clipped
    (``SHOWN_MESSAGE_CHARS``, ``SHOWN_TRACEBACK_CHARS``) with a note saying where the whole text is: ``whole``
    ("rank 1's log, ...") when given, and always ``.failure.message`` and ``.failure.traceback``, kept whole.
    """

    def __init__(self, failure: Failure, failures: list[Failure], note: str = "", earlier: list[str] | None = None,
                 whole: str | None = None):
        self.rank = failure.rank
        self.failure = failure
        self.failures = failures
        self.note = note
        self.earlier = list(earlier or [])  # why each earlier attempt failed, when restarts ran out
        self.whole = whole or "this error's .failure.message and .failure.traceback"
        super().__init__(self.render())

    def summary(self) -> str:
        headline = clipped(self.failure.headline(), SHOWN_MESSAGE_CHARS, self.whole)
        if self.failure.kind == FailureKind.TIMEOUT:
            stuck = sorted(f.rank for f in self.failures if f.kind == FailureKind.TIMEOUT)
            return f"a collective timed out on rank(s) {', '.join(map(str, stuck))}: {headline}"
        return f"rank {self.rank} failed: {headline}"

    def shown_traceback(self) -> str:
        """The failing rank's traceback as the notebook shows it (clipped where huge)."""
        return clipped_lines(self.failure.traceback.rstrip(), SHOWN_MESSAGE_CHARS, SHOWN_TRACEBACK_CHARS,
                             self.whole)

    def render(self) -> str:
        parts = [self.summary()]
        if self.earlier:  # restarts ran out: the earlier attempts' causes above the last one's error
            parts = [f"every attempt failed (restarts used up: {len(self.earlier)}); earlier attempts:"]
            parts += [f"  {line}" for line in self.earlier]
            parts.append(f"attempt {len(self.earlier) + 1}, the last: {self.summary()}")
        if self.note:
            parts.append(self.note)
        if self.failure.traceback:
            parts.append(f"\n--- traceback of rank {self.rank} ---\n{self.shown_traceback()}")
        return "\n".join(parts)


_DISTRIBUTED = re.compile(r"gloo|nccl|c10d|TCPStore|ProcessGroup", re.IGNORECASE)


def classify(exc: BaseException) -> FailureKind:
    """'comm' for a lost peer, 'timeout' for a collective that timed out, else 'user'.

    Only errors raised by torch.distributed count as the first two: a user's own
    TimeoutError or ConnectionError is a real error of its rank.
    """
    text = f"{type(exc).__name__}: {exc}"
    distributed = type(exc).__name__.startswith("Dist") or (isinstance(exc, RuntimeError)
                                                           and _DISTRIBUTED.search(text) is not None)
    if not distributed:
        return FailureKind.USER
    if _TIMEOUT_PATTERNS.search(text) and not _COMM_PATTERNS.search(text):
        return FailureKind.TIMEOUT
    return FailureKind.COMM


def nccl_watchdog_timeout(output: str) -> str | None:
    """The NCCL watchdog's timeout message in a rank's output (its last), or None.

    Under torch's default NCCL error handling the watchdog thread aborts the rank (SIGABRT) at the timeout, so no
    Python exception is raised: a rank killed by SIGABRT whose output ends with this message timed out in a
    collective; it did not crash.
    """
    found = _NCCL_WATCHDOG.findall(output)
    return found[-1].strip() if found else None


def format_exception(exc: BaseException, labels: dict[str, str] | None = None) -> str:
    """The traceback as the user should read it.

    Frames inside ddp_notebook are dropped, and notebook cells are named the way
    IPython names them (``Cell In[5]``), with the cell's own line numbers.
    """
    labels = labels or {}
    te = traceback.TracebackException.from_exception(exc, capture_locals=False)
    seen = set()
    link = te
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        frames = [f for f in link.stack if not f.filename.startswith(_PACKAGE_DIR + os.sep)]
        link.stack = traceback.StackSummary.from_list(
            [traceback.FrameSummary(labels.get(f.filename, f.filename), f.lineno, f.name, line=f.line) for f in frames]
        )
        link = link.__cause__ or link.__context__
    return "".join(te.format())


def blame(failures: list[Failure]) -> Failure:
    """The failure that caused the others.

    A bystander whose collective lost its peer fails too, sometimes before the
    real report arrives; so real errors come before lost-peer errors, and within
    a kind the earliest time on the ranks' own clocks wins, not arrival order.
    """
    order = {FailureKind.USER: 0, FailureKind.STARTUP: 0, FailureKind.EXIT: 1, FailureKind.TIMEOUT: 2,
             FailureKind.COMM: 3, FailureKind.INTERRUPTED: 4}
    return min(failures, key=lambda f: (order.get(f.kind, 0), f.time, f.rank))
