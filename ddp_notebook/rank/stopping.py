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

CHECK_S = 0.05  # how often a loop's boundaries take part in an agreement (of the slowest rank's steps)
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
        self.marks = 0  # loader batches and should_stop() calls (boundaries, agreed on or not)
        self.marks_at_forward = 0  # ... as the last DDP training forward began
        self.pace = 1  # boundaries from one agreement to the next (agreed at the last one)
        self.unchecked = 0  # boundaries since the last agreement
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


def at_batch(where: Callable[[], dict]) -> bool:
    """A ``distributed_loader``'s batch is about to be handed out: True when every rank has agreed to stop here,
    ``where()`` ({epoch, batch}) is then kept."""
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return False
    state = _state(ctx)
    state.marks += 1
    return _at_boundary(ctx, state, where)


def _at_boundary(ctx, state: _State, where: Callable[[], dict]) -> bool:
    """A boundary (a ``distributed_loader`` batch, a ``should_stop()`` call, a DDP training forward): True when
    every rank has agreed to stop here; ``where()`` ({epoch, batch} or {step}) is then kept.

    Not every boundary takes part in an agreement: each agreement also settles how many boundaries to the next,
    about ``CHECK_S`` of the slowest rank's steps, so a loop of small steps pays for one all-reduce per 50 ms
    (one a batch cost a loop of 1.7 ms steps about as much again).  Every rank counts the same boundaries, so
    they all agree at the same one."""
    if state.agreed:
        return True
    state.unchecked += 1
    if state.unchecked < state.pace:
        return False
    pace = 1
    if state.checked_at is not None:
        per_boundary = max((time.perf_counter() - state.checked_at) / state.unchecked, 1e-6)
        pace = max(1, min(_MAX_PACE, int(CHECK_S / per_boundary)))
    if _agree(ctx, state, pace):
        state.agreed = True
        state.where = dict(where())
    state.unchecked, state.checked_at = 0, time.perf_counter()
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

    Every rank must call it equally often (about every 50 ms of steps it takes part in a small collective); it
    stays True once True.
    """
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return False
    state = _state(ctx)
    if state.agreed:
        return True
    state.steps += 1
    state.marks += 1
    step = state.steps - 1
    return _at_boundary(ctx, state, lambda: {"step": step})


def at_forward() -> None:
    """A DDP model's training forward is about to run (every rank runs it in step): a boundary unless another one
    (a ``distributed_loader`` batch, ``should_stop()``) came since the last such forward.  Raises
    :class:`TrainingStopped` once every rank agreed to stop: the cell ends there."""
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        return
    state = _state(ctx)
    state.forwards += 1
    if not state.agreed and state.marks == state.marks_at_forward:
        step = state.forwards - 1
        _at_boundary(ctx, state, lambda: {"step": step})
    state.marks_at_forward = state.marks
    if state.agreed:
        raise TrainingStopped()
