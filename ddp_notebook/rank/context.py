"""Where this process stands: inside a rank of a job, or not.

Rank-side code (``report``, loaders, checkpoints) asks here for the rank and
the channel to the notebook.  Importing this module costs nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    """The task a rank runs now, as its ``RUN`` message said (or an export's ``task`` under torchrun)."""

    id: Any  # the job's task number (an export's: its own)
    attempt: int | None = None  # 0, then 1, 2, ... after each restart; None: torch elastic's count (attempt())
    every_rank_runs: bool = True  # False: --ranks picked some of a warm pool's ranks
    profile: dict | None = None  # --profile's window of steps (rank/profiling.py)
    results_file: tuple | None = None  # (the notebook's pid, this rank's file descriptor there): big results


@dataclass
class RankContext:
    """What a rank knows of itself and its job; what the rank side's helpers read."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: Any = None  # torch.device, set once torch is imported; None in spawn() on GPUs (the user's code picks)
    sender: Any = None  # channel.Sender to the notebook, None under plain torchrun
    store: Any = None  # the job's store, once the process group is made (rank/rendezvous.py meets in it)
    cpu_group: Any = None  # a gloo group beside an NCCL one: a graceful stop's flag is reduced on the CPU
    task: Task | None = None  # the task running now
    stop_state: Any = None  # rank/stopping.py's, for the task running now
    unreachable: str | None = None  # under torchrun: why this rank could not reach the notebook
    unreached_why: str | None = None  # ... and why some rank could not (every rank agrees on it)

    @property
    def task_id(self) -> Any:
        """The running task's number, or None between tasks and under plain torchrun."""
        return self.task.id if self.task is not None else None


_current: RankContext | None = None


def set_current(ctx: RankContext | None) -> None:
    global _current
    _current = ctx


def current() -> RankContext | None:
    """The rank context of this process, or None outside a job.

    Under torchrun (no notebook), the context is built from the environment
    contract so the toolkit's helpers keep working.
    """
    global _current
    if _current is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _current = RankContext(
            rank=int(os.environ["RANK"]),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        )
    return _current


def attempt() -> int:
    """Which attempt of the job this is: 0, then 1, 2, ... after each restart (``--max-restarts``).

    Under torchrun it is the agent's restart count (``TORCHELASTIC_RESTART_COUNT``); 0 outside a job.
    """
    ctx = current()
    if ctx is not None and ctx.task is not None and ctx.task.attempt is not None:
        return ctx.task.attempt
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def send(kind: str, body: dict) -> bool:
    """Send an event to the notebook if there is one; True when sent."""
    ctx = current()
    if ctx is None or ctx.sender is None:
        return False
    ctx.sender.send(kind, body)
    return True
