"""Rank output relayed to the notebook, line-prefixed, batched and paced.

Jupyter's server drops output above 1,000 messages/s or 1 MB/s; a rank that
prints in a tight loop must not trip that nor freeze the page.  Lines are
gathered and written at most ``rate`` times a second, within a byte budget;
when a batch is over budget its oldest lines are elided and the cell says how
many.  The newest lines are always kept, and the final flush shows the tail.
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


class OutputRelay:
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

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        """Lines of a rank; rank -1: lines of the torchrun agent that runs this host's ranks (always shown)."""
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
                self._write(name, lines)

    def _write(self, name: str, lines: list[tuple[int, str]]) -> None:
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
        stream.flush()


def _label(rank: int) -> str:
    return f"[rank {rank}]" if rank >= 0 else "[torchrun]"


def _last_drawn(line: str) -> str:
    if "\r" not in line:
        return line
    segments = [segment for segment in line.split("\r") if segment]
    return segments[-1] if segments else ""
