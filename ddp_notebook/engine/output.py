"""Rank output relayed to the notebook, line-prefixed, batched and paced.

Jupyter's server drops output above 1,000 messages/s or 1 MB/s; a rank that
prints in a tight loop must not trip that nor freeze the page.  Lines are
gathered and written at most ``rate`` times a second, within a byte budget;
when a batch is over budget its oldest lines are elided and the cell says how
many.  The newest lines are always kept, and the final flush shows the tail; a line longer than a flush's
budget (a rank's share of it) is shown clipped to it, its start and end, with a note of how much was cut and
where the whole line is (the rank's log: :meth:`OutputRelay.log`, ``--log-dir``: :class:`RankLogs`).

A rank's stdout and stderr lines keep the order they arrived in.  A line a rank
redraws after ``\r`` (a tqdm bar) is shown at the same pace while it is drawn:
each flush writes its newest state, labelled, after ``\r`` (Jupyter's stream
output, like a terminal, overwrites the line).  One line can be redrawn: with
several ranks drawing at once it shows the newest redraw of any.
"""
from __future__ import annotations

import itertools
import operator
import os
import sys
import threading
import time
from typing import Callable, TextIO

from ..wire import safe_files
from ..wire.errors import LaunchError, clipped


LOG_BYTES_PER_RANK = 16 << 20  # job.logs(rank) keeps each rank's newest 16 MB
MIN_LINE_CHARS = 1_000  # a line is clipped to its rank's share of a flush's budget, but never below this


class LogFolderWarning(safe_files.SharedFolderWarning):
    """Other users may write in the folder of ``--log-dir``."""


class RankLogs:
    """The files of ``--log-dir``: each rank's complete output appended to ``rank<N>.log``.

    The folder is opened once and every log is opened through its descriptor, only when it is a regular file of
    this user's with no other name (:func:`~ddp_notebook.wire.safe_files.open_own_file`: never through a link, never
    waiting on a FIFO; a new one 0600).  A log is written by the job's thread alone; a refused one is not written,
    and said once (:meth:`write`)."""

    def __init__(self, path: str, folder_fd: int):
        self.path = path
        self._folder = folder_fd
        self._files: dict[int, int] = {}
        self._refused: set[int] = set()

    @classmethod
    def open(cls, log_dir: str, ranks) -> "RankLogs":
        """The folder ``log_dir`` (made if missing) and the logs of ``ranks``, opened before anything starts: a
        LaunchError names a log that is not a file of this user's (and what it is, and whose), or a folder that
        cannot be written.  Warns (:class:`LogFolderWarning`) when other users may write in the folder."""
        path = os.path.abspath(os.path.expanduser(os.fspath(log_dir)))
        try:
            os.makedirs(path, exist_ok=True)
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # (a link the user made is theirs)
        except OSError as exc:
            raise LaunchError(f"--log-dir {log_dir}: cannot make or open it: {exc.strerror}") from None
        logs = cls(path, fd)
        try:
            if not os.access(path, os.W_OK | os.X_OK):
                raise LaunchError(f"--log-dir {log_dir}: not writable")
            safe_files.warn_if_shared(fd, path, "another user could remove the rank logs or put something of theirs "
                                     "at their names (a log is written only when it is a plain file of yours)",
                                     "log into a folder only you can write in", LogFolderWarning, stacklevel=3)
            for rank in ranks:
                try:
                    logs._open(rank)
                except safe_files.NotOwnFileError as exc:
                    raise LaunchError(f"--log-dir {log_dir}: {exc}; no rank was started (remove it, or log into a "
                                      f"folder only you can write in)") from None
                except OSError as exc:
                    raise LaunchError(f"--log-dir {log_dir}: cannot open {logs.path_of(rank)}: "
                                      f"{exc.strerror}") from None
        except BaseException:
            logs.close()
            raise
        return logs

    def path_of(self, rank: int) -> str:
        return os.path.join(self.path, f"rank{rank}.log")

    def _open(self, rank: int) -> int:
        fd = self._files.get(rank)
        if fd is None:
            fd = self._files[rank] = safe_files.open_own_file(
                f"rank{rank}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, dir_fd=self._folder,
                shown=self.path_of(rank))
        return fd

    def write(self, rank: int, data: bytes) -> str | None:
        """Append ``data`` to rank ``rank``'s log; the reason, the first time, when its log is refused (None
        otherwise, and every later time: a refused log is not tried again)."""
        if rank in self._refused:
            return None
        try:
            fd = self._open(rank)
        except safe_files.NotOwnFileError as exc:
            self._refused.add(rank)
            return f"{exc}; rank {rank}'s output is not logged there"
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        return None

    def close(self) -> None:
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
        if self._folder >= 0:
            os.close(self._folder)
            self._folder = -1


class OutputRelay:
    """Relays rank output to the cell (see the module docstring) and keeps each rank's complete output: the newest
    ``LOG_BYTES_PER_RANK`` bytes in memory (:meth:`log`), everything in ``logs`` (``--log-dir``) when set."""

    def __init__(
        self,
        out: TextIO | None = None,
        err: TextIO | None = None,
        *,
        ranks: set[int] | None = None,
        interval: float = 0.2,
        bytes_per_second: int = 200_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._streams = {"stdout": out, "stderr": err}
        self.ranks = ranks  # None: every rank
        self.interval = interval
        self.budget = int(bytes_per_second * interval)
        self._clock = clock
        self._pending: list[tuple[str, int, str]] = []  # (stream, rank, line): whole lines in arrival order
        self._partial: dict[tuple[int, str], str] = {}  # (rank, stream): its line not ended yet (unended_line)
        self._open: tuple[str, str] | None = None  # (stream, text): the redrawn line written without its newline
        self._last_flush = clock()
        self.elided = 0
        self.lines_seen = 0
        self.logs: RankLogs | None = None
        self._logs: dict[int, bytearray] = {}

    def _keep(self, rank: int, data: bytes) -> None:
        kept = self._logs.setdefault(rank, bytearray())
        kept += data
        if len(kept) > LOG_BYTES_PER_RANK:
            cut = len(kept) - LOG_BYTES_PER_RANK
            newline = kept.find(b"\n", cut)
            del kept[:newline + 1 if 0 <= newline < cut + 4096 else cut]  # from a whole line where one is near
        if self.logs is not None:
            refused = self.logs.write(rank, data)
            if refused is not None:
                stream = self._streams["stderr"] or sys.stderr
                stream.write(f"[ddp_notebook] {refused}\n")

    def add_to_log(self, rank: int, text: str) -> None:
        """Keep ``text`` in rank ``rank``'s log without showing it (what the notebook showed of it clipped)."""
        self._keep(rank, text.encode("utf-8", "replace"))

    def whole_text_at(self, rank: int) -> str:
        """Where the whole of what the notebook shows clipped of rank ``rank`` is: its log."""
        if self.logs is not None:
            return f"rank {rank}'s log, {self.logs.path_of(rank)}"
        return f"rank {rank}'s log, job.logs({rank}) (ddp_notebook.last_job() is the latest job)"

    def clipped(self, rank: int, text: str, limit: int) -> str:
        """``text`` of rank ``rank`` as the notebook shows it: at most about ``limit`` characters, with a note of
        what was cut (``wire.errors.clipped``)."""
        return clipped(text, max(limit, MIN_LINE_CHARS), self.whole_text_at(rank))

    def log(self, rank: int) -> str:
        """Everything rank ``rank`` wrote to stdout and stderr (its newest 16 MB), what the cell elided too."""
        return bytes(self._logs.get(rank, b"")).decode("utf-8", "replace")

    def log_to(self, logs: "RankLogs | None") -> None:
        """Also write every rank's output into ``logs`` (``--log-dir``) until :meth:`close_logs`."""
        self.logs = logs

    def close_logs(self) -> None:
        """The job has ended: close the files of ``--log-dir``."""
        if self.logs is not None:
            self.logs.close()
        self.logs = None  # (a warm pool's ranks may still print between cells: not into this job's files)

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """Lines of a rank; rank -1: lines of the torchrun agent that runs this host's ranks (always shown)."""
        self._keep(rank, data)
        if self.ranks is not None and rank not in self.ranks and rank >= 0:
            return
        text = self._partial.pop((rank, stream), "") + data.decode("utf-8", "replace")
        lines = text.split("\n")
        if lines[-1]:
            self._partial[(rank, stream)] = unended_line(lines[-1])  # (last: the newest drawn)
        prefix = _label(rank) + " "
        self._pending.extend((stream, rank, prefix + shown_line(line) + "\n") for line in lines[:-1])
        self.lines_seen += len(lines) - 1

    def maybe_flush(self) -> None:
        if self._clock() - self._last_flush >= self.interval:
            self.flush()

    def flush(self, final: bool = False) -> None:
        if final:
            for (rank, stream), rest in sorted(self._partial.items()):
                if not rest.startswith("\r") or rest.strip():  # (a bar that cleared its line has left nothing)
                    self._pending.append((stream, rank, f"{_label(rank)} {rest.strip(chr(13))}\n"))
            self._partial.clear()
        self._last_flush = self._clock()
        lines, self._pending = self._pending, []
        writes = self._within_budget(lines) if lines else []
        redrawn = None if final else self._redrawn_line()
        if self._open is not None and (writes or redrawn != self._open):
            writes = self._leave_open_line(writes, redrawn)
        if redrawn is not None and redrawn != self._open:
            writes.append(redrawn)
            self._open = redrawn
        if writes:
            self._write(writes, final)

    def _redrawn_line(self) -> tuple[str, str] | None:
        """(stream, labelled text) of the newest line being redrawn after "\r" and not blank, if any."""
        for (rank, stream), partial in reversed(self._partial.items()):
            if partial.startswith("\r") and partial.strip():
                return stream, f"{_label(rank)} {self.clipped(rank, partial.strip(chr(13)), self.budget)}"
        return None

    def _leave_open_line(self, writes: list[tuple[str, str]],
                         redrawn: tuple[str, str] | None) -> list[tuple[str, str]]:
        """``writes``, first moving off the open (redrawn) line: the next line written to its stream overwrites
        it, padded to its width (as tqdm pads its own redraws), unless that padding would be longer than a line
        is ever shown whole (a clipped huge bar: the padding would be a flush's budget more); otherwise, and for
        output to the other stream, it ends where it is."""
        stream, shown = self._open
        self._open = None
        if writes and writes[0][0] == stream and len(shown) - len(writes[0][1]) < MIN_LINE_CHARS:
            return [(stream, "\r" + writes[0][1][:-1].ljust(len(shown)) + "\n"), *writes[1:]]
        if writes:
            return [(stream, "\n"), *writes]
        if redrawn is not None and redrawn[0] == stream:
            self._open = redrawn
            return [(stream, "\r" + redrawn[1].ljust(len(shown)))]
        return [(stream, "\r" + " " * len(shown) + "\r")]  # the bar cleared its line, or moved to the other stream

    def _within_budget(self, lines: list[tuple[str, int, str]]) -> list[tuple[str, str]]:
        """(stream, line) to write: each rank gets an equal share of the budget and keeps its newest lines; a line
        says how many older ones were elided."""
        ranks = sorted({rank for _, rank, _ in lines})
        share = self.budget // len(ranks)
        keep, dropped, used = [False] * len(lines), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
        for i in range(len(lines) - 1, -1, -1):
            _, rank, line = lines[i]
            if used[rank] + len(line) <= share or used[rank] == 0:
                if len(line) > max(share, MIN_LINE_CHARS):  # one huge line: its start and end
                    label = _label(rank) + " "
                    line = label + self.clipped(rank, line[len(label):-1], share) + "\n"
                    lines[i] = (lines[i][0], rank, line)
                used[rank] += len(line)
                keep[i] = True
            else:
                used[rank] = share + 1  # once over budget, everything older goes
                dropped[rank] += 1
        self.elided += sum(dropped.values())
        notices = [(lines[0][0], f"[ddp_notebook] ... {dropped[r]} lines of {_label(r)[1:-1]} elided "
                                 f"(output rate limit) ...\n") for r in ranks if dropped[r]]
        return notices + [(stream, line) for (stream, _, line), kept in zip(lines, keep) if kept]

    def _write(self, writes: list[tuple[str, str]], final: bool = False) -> None:
        # What goes to one stream in a row is written at once; each stream is flushed before the other is written,
        # so that they reach the notebook in order.
        runs: list[tuple[TextIO, str]] = []
        for name, texts in itertools.groupby(writes, key=operator.itemgetter(0)):
            stream = self._streams[name] or (sys.stdout if name == "stdout" else sys.stderr)
            text = "".join(text for _, text in texts)
            if runs and runs[-1][0] is stream:  # (both streams may be one, a background job's log)
                text = runs.pop()[1] + text
            runs.append((stream, text))
        for i, (stream, text) in enumerate(runs):
            stream.write(text)
            if not (final and i == len(runs) - 1 and _kernel_flushes(stream)):
                stream.flush()


def _kernel_flushes(stream) -> bool:
    """True for a Jupyter kernel's own output stream written from the kernel's main thread, at the end of a cell:
    the kernel flushes it before the cell's reply, and before any display or error output, so the order holds
    without a flush of ours (each one waits for the kernel's I/O thread, a millisecond on a busy machine)."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream) \
        and threading.current_thread() is threading.main_thread()


def release_kernel_pipe() -> None:
    """The calling thread is about to end: close the socket a Jupyter kernel opened for it, now.

    ipykernel gives each thread that prints or publishes output its own zmq socket to the kernel's I/O thread (an
    eventfd), and closes those of ended threads only every 10 s (Python has no hook for a thread's end,
    ipython/ipykernel#1125): every background job's thread, and every dashboard's, would hold a descriptor of the
    kernel's for that long.  What the thread sent is flushed first, so nothing it asked of the I/O thread waits on the
    socket; a thread that never wrote, or a process that is not a kernel (or a kernel laid out otherwise), is left
    alone."""
    iostream = sys.modules.get("ipykernel.iostream")
    if iostream is None:
        return
    stream = next((s for s in (sys.stdout, sys.stderr) if isinstance(s, iostream.OutStream)), None)
    iopub = getattr(stream, "pub_thread", None)
    local = getattr(iopub, "_local", None)  # ipykernel's per-thread state: event_pipe, this thread's socket
    pipes = getattr(iopub, "_event_pipes", None)  # thread -> socket, what its periodic clean-up closes
    lock = getattr(iopub, "_event_pipe_gc_lock", None)
    pipe = getattr(local, "event_pipe", None)
    if pipe is None or not isinstance(pipes, dict) or lock is None:
        return
    stream.flush()  # waits for the I/O thread to have done everything queued before it, this thread's sends too
    with lock:
        if pipes.get(threading.current_thread()) is pipe:
            del pipes[threading.current_thread()]
        del local.event_pipe  # should the thread write again after all, it gets a new one
    pipe.close()


def _label(rank: int) -> str:
    return f"[rank {rank}]" if rank >= 0 else "[torchrun]"


def unended_line(line: str) -> str:
    """A line not ended yet, kept short: what a terminal shows of it, marked where it was redrawn after "\\r" (it
    starts with "\\r"; it ends with one when the next write starts over at its beginning)."""
    if "\r" not in line:
        return line
    return "\r" + shown_line(line) + ("\r" if line.endswith("\r") else "")


def shown_line(line: str) -> str:
    """What a terminal shows of a line redrawn after "\\r": its last drawing (a progress bar pads its redraws to
    cover the one before)."""
    if "\r" not in line:
        return line
    segments = [segment for segment in line.split("\r") if segment]
    return segments[-1] if segments else ""
