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
        self._pending: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._partial: dict[tuple[int, str], str] = {}
        self._last_flush = clock()
        self.elided = 0
        self.lines_seen = 0

    def feed(self, rank: int, stream: str, data: bytes) -> None:
        if self.ranks is not None and rank not in self.ranks:
            return
        text = self._partial.pop((rank, stream), "") + data.decode("utf-8", "replace")
        lines = text.split("\n")
        if lines[-1]:
            self._partial[(rank, stream)] = lines[-1]
        prefix = f"[rank {rank}] "
        for line in lines[:-1]:
            self._pending[stream].append(prefix + line + "\n")
        self.lines_seen += len(lines) - 1

    def maybe_flush(self) -> None:
        if self._clock() - self._last_flush >= self.interval:
            self.flush()

    def flush(self, final: bool = False) -> None:
        if final:
            for (rank, stream), rest in sorted(self._partial.items()):
                self._pending[stream].append(f"[rank {rank}] {rest}\n")
            self._partial.clear()
        self._last_flush = self._clock()
        for name, lines in self._pending.items():
            if not lines:
                continue
            self._pending[name] = []
            kept, size = [], 0
            for line in reversed(lines):
                size += len(line)
                if size > self.budget and kept:
                    break
                kept.append(line)
            dropped = len(lines) - len(kept)
            kept.reverse()
            if dropped:
                self.elided += dropped
                kept.insert(0, f"[ddp_notebook] ... {dropped} lines elided (output rate limit) ...\n")
            stream = self._streams[name] or (sys.stdout if name == "stdout" else sys.stderr)
            stream.write("".join(kept))
            stream.flush()
