"""Where each rank is: every rank's Python stack, read while it runs (``job.stacks()``, ``%ddp_stacks``).

Each rank registers :mod:`faulthandler` on SIGUSR1 at start, writing to a file in the job's directory; the C-level
handler dumps every thread's Python frames even while the main thread is blocked in a collective or in C code.
The notebook signals the ranks, reads the files, keeps each rank's main thread, drops the toolkit's own frames
and names notebook cells as tracebacks do (``Cell In[5] line 12``), grouping ranks whose stacks are the same.
"""
from __future__ import annotations

import os
import re
import signal
import sysconfig
import time
from dataclasses import dataclass

from ..wire import payload, protocol

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})


@dataclass(frozen=True)
class Frame:
    file: str  # a path, or the cell's label ("Cell In[5]")
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file} line {self.line}" if self.file.startswith("Cell In[") else \
            f"{self.function} ({os.path.basename(self.file)}:{self.line})"


def parse(text: str) -> list[list[Frame]]:
    """faulthandler's dump: the threads, each a list of frames, innermost first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        else:
            match = _FRAME.match(line)
            if match and threads:
                threads[-1].append(Frame(match.group(1), int(match.group(2)), match.group(3)))
    return threads


_MAINS = (os.path.join("rank", "worker.py"), os.path.join("rank", "torchrun.py"))  # an export's rank: torchrun.py


def _main_thread(threads: list[list[Frame]]) -> list[Frame] | None:
    """The thread that runs the task: the one whose outermost toolkit frame is the rank's ``main`` (``forked_main``
    in a rank forked from the rank template)."""
    for frames in threads:
        if any(f.function in ("main", "forked_main") and f.file.endswith(_MAINS) for f in frames):
            return frames
    return threads[0] if threads else None


class RankStacks:
    """Each rank's stack (``frames[rank]``, innermost first, the user's frames and the call they are in)."""

    def __init__(self, frames: dict[int, list[Frame] | None], labels: dict[str, str]):
        self.labels = labels
        self.frames = {rank: self._visible(f) if f is not None else None for rank, f in frames.items()}

    def _visible(self, frames: list[Frame]) -> list[Frame]:
        """The frames outside the toolkit (and Python's start-up); a cell's under its label."""
        shown = []
        for frame in frames:
            if frame.file.startswith((_PACKAGE_DIR + os.sep, "<frozen ")) or frame.file.endswith("runpy.py"):
                continue
            shown.append(Frame(self.labels.get(frame.file, frame.file), frame.line, frame.function))
        return shown

    def where(self, rank: int) -> str:
        """One line: the innermost call, then the user's frames outwards ("all_reduce ← Cell In[5] line 12")."""
        frames = self.frames.get(rank)
        if frames is None:
            return "no answer (not running, or not a ddp_notebook rank)"
        if not frames:
            return "idle (between cells)"
        user = [i for i, f in enumerate(frames) if not f.file.startswith(LIBRARY_DIRS)]
        first_user = user[0] if user else len(frames) - 1
        parts = ([frames[0].function] if first_user > 0 else []) + [str(f) for f in frames[first_user:]]
        return " ← ".join(parts)

    def __str__(self) -> str:
        groups: dict[str, list[int]] = {}
        for rank in sorted(self.frames):
            groups.setdefault(self.where(rank), []).append(rank)
        lines = []
        for where, ranks in groups.items():
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
            lines.append(f"{who}: {where}")
        return "\n".join(lines)

    __repr__ = __str__


def collect(group, ranks: list[int], wait: float = 2.0) -> RankStacks:
    """Signal the ranks of a backend and read their stacks (up to ``wait`` seconds for the dumps); an export's
    ranks (a Slurm task, a rank of another host) are asked over the channel (``group.where``)."""
    workdir = group.workdir
    frames: dict[int, list[Frame] | None] = {rank: None for rank in ranks}
    asked = []
    for rank in ranks if workdir is not None else ():
        path = protocol.stacks_path(workdir, rank)
        pid = group.pids.get(rank)
        if pid is None or rank not in group.alive or not os.path.exists(path):
            continue
        with open(path, "w"):
            pass  # empty it: the rank appends its new dump
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
        asked.append(rank)
    deadline = time.monotonic() + wait
    texts: dict[int, str] = {}
    while asked and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(asked):
            try:
                with open(protocol.stacks_path(workdir, rank)) as handle:
                    text = handle.read()
            except OSError:
                continue
            if text and text == texts.get(rank):  # written and no longer growing
                asked.remove(rank)
            texts[rank] = text
    rest = [rank for rank in ranks if not texts.get(rank)]  # (where() knows which it can ask)
    if rest:
        for rank, body in group.where(rest, wait, collectives=False, stack=True).items():
            if body.get("stack"):
                texts[rank] = body["stack"]
    for rank, text in texts.items():
        frames[rank] = _main_thread(parse(text))
    return RankStacks(frames, payload.cell_labels())
