"""Where this process stands: inside a rank of a job, or not.

Rank-side code (``report``, loaders, checkpoints) asks here for the rank and
the channel to the notebook.  Importing this module costs nothing.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RankContext:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: Any = None  # torch.device, set once torch is imported
    sender: Any = None  # channel.Sender to the notebook, None under plain torchrun
    extra: dict = field(default_factory=dict)


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
    if ctx is not None and "attempt" in ctx.extra:
        return int(ctx.extra["attempt"])
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def send(kind: str, body: dict) -> bool:
    """Send an event to the notebook if there is one; True when sent."""
    ctx = current()
    if ctx is None or ctx.sender is None:
        return False
    ctx.sender.send(kind, body)
    return True
