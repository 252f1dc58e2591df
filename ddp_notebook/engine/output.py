"""Rank output relayed to the notebook, line-prefixed, batched and paced.

Jupyter's server drops output above 1,000 messages/s or 1 MB/s; a rank that
prints in a tight loop must not trip that nor freeze the page.  Lines are
gathered and written at most ``rate`` times a second, within a byte budget;
when a batch is over budget its oldest lines are elided and the cell says how
many.  The newest lines are always kept, and the final flush shows the tail.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO


LOG_BYTES_PER_RANK = 16 << 20  # job.logs(rank) keeps each rank's newest 16 MB


class OutputRelay:
    """Relays rank output to the cell (see the module docstring) and keeps each rank's complete output: the newest
    ``LOG_BYTES_PER_RANK`` bytes in memory (:meth:`log`), everything in ``log_dir/rank<N>.log`` when set."""

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
        self._pending: dict[str, list[tuple[int, str]]] = {"stdout": [], "stderr": []}
        self._partial: dict[tuple[int, str], str] = {}
        self._last_flush = clock()
        self.elided = 0
        self.lines_seen = 0
        self.log_dir: str | None = None
        self._logs: dict[int, bytearray] = {}
        self._log_files: dict[int, object] = {}

    def _keep(self, rank: int, data: bytes) -> None:
        kept = self._logs.setdefault(rank, bytearray())
        kept += data
        if len(kept) > LOG_BYTES_PER_RANK:
            cut = len(kept) - LOG_BYTES_PER_RANK
            newline = kept.find(b"\n", cut)
            del kept[:newline + 1 if 0 <= newline < cut + 4096 else cut]  # from a whole line where one is near
        if self.log_dir is not None:
            handle = self._log_files.get(rank)
            if handle is None:
                handle = self._log_files[rank] = open(os.path.join(self.log_dir, f"rank{rank}.log"), "ab")
            handle.write(data)

    def log(self, rank: int) -> str:
        """Everything rank ``rank`` wrote to stdout and stderr (its newest 16 MB), what the cell elided too."""
        return bytes(self._logs.get(rank, b"")).decode("utf-8", "replace")

    def close_logs(self) -> None:
        """The job has ended: close the files of ``log_dir``."""
        for handle in self._log_files.values():
            handle.close()
        self._log_files.clear()
        self.log_dir = None  # (a warm pool's ranks may still print between cells: not into this job's files)

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """Lines of a rank; rank -1: lines of the torchrun agent that runs this host's ranks (always shown)."""
        self._keep(rank, data)
        if self.ranks is not None and rank not in self.ranks and rank >= 0:
            return
        text = self._partial.pop((rank, stream), "") + data.decode("utf-8", "replace")
        # A progress bar redraws its line after "\r": only what a terminal would show is kept, so a
        # line that is never ended cannot grow without bound.
        lines = [_last_drawn(line) for line in text.split("\n")]
        if lines[-1]:
            self._partial[(rank, stream)] = lines[-1]
        prefix = _label(rank) + " "
        self._pending[stream].extend((rank, prefix + line + "\n") for line in lines[:-1])
        self.lines_seen += len(lines) - 1

    def maybe_flush(self) -> None:
        if self._clock() - self._last_flush >= self.interval:
            self.flush()

    def flush(self, final: bool = False) -> None:
        if final:
            for (rank, stream), rest in sorted(self._partial.items()):
                self._pending[stream].append((rank, f"{_label(rank)} {rest}\n"))
            self._partial.clear()
        self._last_flush = self._clock()
        for name, lines in self._pending.items():
            if lines:
                self._pending[name] = []
                self._write(name, lines, final)

    def _write(self, name: str, lines: list[tuple[int, str]], final: bool = False) -> None:
        # Each rank gets an equal share of the budget and keeps its newest lines.
        ranks = sorted({rank for rank, _ in lines})
        share = self.budget // len(ranks)
        keep, dropped, used = [False] * len(lines), dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0)
        for i in range(len(lines) - 1, -1, -1):
            rank, line = lines[i]
            if used[rank] + len(line) <= share or used[rank] == 0:
                used[rank] += len(line)
                keep[i] = True
            else:
                used[rank] = share + 1  # once over budget, everything older goes
                dropped[rank] += 1
        out = [f"[ddp_notebook] ... {dropped[r]} lines of {_label(r)[1:-1]} elided (output rate limit) ...\n"
               for r in ranks if dropped[r]]
        self.elided += sum(dropped.values())
        out += [line for (_, line), kept in zip(lines, keep) if kept]
        stream = self._streams[name] or (sys.stdout if name == "stdout" else sys.stderr)
        stream.write("".join(out))
        if not (final and _kernel_flushes(stream)):
            stream.flush()


def _kernel_flushes(stream) -> bool:
    """True for a Jupyter kernel's own output stream written from the kernel's main thread, at the end of a cell:
    the kernel flushes it before the cell's reply, and before any display or error output, so the order holds
    without a flush of ours (each one waits for the kernel's I/O thread, a millisecond on a busy machine)."""
    iostream = sys.modules.get("ipykernel.iostream")
    return iostream is not None and isinstance(stream, iostream.OutStream) \
        and threading.current_thread() is threading.main_thread()


def _label(rank: int) -> str:
    return f"[rank {rank}]" if rank >= 0 else "[torchrun]"


def _last_drawn(line: str) -> str:
    if "\r" not in line:
        return line
    segments = [segment for segment in line.split("\r") if segment]
    return segments[-1] if segments else ""
