"""Rank side of a graceful stop: every rank agrees to stop at the same batch boundary.

The notebook sends ``STOP``; at each boundary (each batch of a ``distributed_loader``, each :func:`should_stop`
call, each training forward of a DDP model that no other boundary came before: :func:`at_forward`) the rank reads what has arrived (:func:`set_poll`), which marks the task (:func:`request`), and every rank
takes part in one small all-reduce of its mark, so all of them see the stop at the same boundary and no collective
is left waiting.
Under torchrun, with no notebook to ask for a stop, nothing is exchanged.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from ..wire import protocol
from ..wire.errors import TrainingStopped
from . import context

FORWARD_CHECK_S = 0.05  # how often a loop of DDP forwards (with no other boundary) takes part in an agreement
_MAX_PACE = 1000
_requested: set = set()  # task ids the notebook asked to stop
_lock = threading.Lock()
_poll: Callable[[], None] | None = None


def set_poll(poll: Callable[[], None] | None) -> None:
    """``poll()`` reads the notebook's messages that have arrived during a task (calling :func:`request` for a stop
    request), without waiting; every boundary calls it."""
    global _poll
    _poll = poll


def request(task_id) -> None:
    """The notebook asks the task to stop."""
    with _lock:
        _requested.add(task_id)


class _State:
    """One task's stop state in this rank."""

    def __init__(self, task_id):
        self.task_id = task_id
        self.announced = False
        self.agreed = False
        self.where: dict | None = None
        self.steps = 0  # should_stop() calls
        self.forwards = 0  # DDP training forwards
        self.boundaries = 0  # agreements taken part in
        self.boundaries_at_forward = 0  # ... as the last DDP training forward began
        self.pace = 1  # forwards from one agreement at a forward to the next (agreed at the last one)
        self.unchecked = 0  # forwards since the last agreement at a forward
        self.checked_at: float | None = None


def _state(ctx) -> _State | None:
    state = ctx.stop_state
    if state is None or state.task_id != ctx.task_id:
        state = ctx.stop_state = _State(ctx.task_id)
    return state


def _group(ctx):
    """Where the flag is reduced: a CPU (gloo) group, also under nccl (made once at start-up)."""
    return ctx.cpu_group


def announce() -> None:
    """Tell the notebook, once per task, that this task checks for a graceful stop."""
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return
    state = _state(ctx)
    if not state.announced:
        state.announced = True
        context.send(protocol.STOPPABLE, {"task": state.task_id})


def _agree(ctx, state: _State, pace: int = 1) -> bool:
    import torch
    import torch.distributed as dist

    announce()
    if _poll is not None:
        _poll()
    with _lock:
        mine = state.task_id in _requested
    if not (dist.is_available() and dist.is_initialized()):
        return mine
    flag = torch.tensor([1 if mine else 0, -pace], dtype=torch.int32)  # (-MAX(-pace): the slowest rank's pace)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_group(ctx))
    stop, least = flag.tolist()
    state.pace = -least
    return bool(stop)


def at_boundary(where: dict, pace: int = 1) -> bool:
    """True when every rank has agreed to stop here; ``where`` ({epoch, batch} or {step}) is then kept."""
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return False
    state = _state(ctx)
    if state.agreed:
        return True
    state.boundaries += 1
    if _agree(ctx, state, pace):
        state.agreed = True
        state.where = dict(where)
    return state.agreed


def stopped_at() -> dict | None:
    """Where a graceful stop ended the current task, or None."""
    ctx = context.current()
    if ctx is None:
        return None
    state = ctx.stop_state
    return state.where if state is not None and state.task_id == ctx.task_id and state.agreed else None


def check_not_stopped() -> None:
    """A loader iterated again after the stop: end the cell here (it ends normally)."""
    ctx = context.current()
    if ctx is not None and ctx.sender is not None and _state(ctx).agreed:
        raise TrainingStopped()


def should_stop() -> bool:
    """True on every rank at the same call once the notebook asked for a graceful stop (the stop button,
    the dashboard's Stop, ``job.stop()``); for loops that use no ``distributed_loader``.

    Every rank must call it equally often (it is a small collective); it stays True once True.
    """
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return False
    state = _state(ctx)
    if state.agreed:
        return True
    state.steps += 1
    return at_boundary({"step": state.steps - 1})


def at_forward() -> None:
    """A DDP model's training forward is about to run (every rank runs it in step): a boundary unless another one
    (a ``distributed_loader`` batch, ``should_stop()``) came since the last such forward.  Raises
    :class:`TrainingStopped` once every rank agreed to stop: the cell ends there.

    Not every forward takes part in an agreement: each one also agrees on how many forwards to the next, about
    ``FORWARD_CHECK_S`` of the slowest rank's steps, so a loop of small steps pays for one all-reduce per 50 ms."""
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return
    state = _state(ctx)
    state.forwards += 1
    if not state.agreed and state.boundaries == state.boundaries_at_forward:
        state.unchecked += 1
        if state.unchecked >= state.pace:
            pace = 1
            if state.checked_at is not None:
                per_forward = max((time.perf_counter() - state.checked_at) / state.unchecked, 1e-6)
                pace = max(1, min(_MAX_PACE, int(FORWARD_CHECK_S / per_forward)))
            at_boundary({"step": state.forwards - 1}, pace)
            state.unchecked, state.checked_at = 0, time.perf_counter()
    else:
        state.unchecked, state.checked_at = 0, None
    state.boundaries_at_forward = state.boundaries
    if state.agreed:
        raise TrainingStopped()
