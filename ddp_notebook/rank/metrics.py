"""Rank side of live metrics: ``report()`` and ``progress()``.

``report()`` checks its arguments and appends the call, as given, to a list
that the channel's sender thread takes in batches, turns into records
(``_record``) and sends, so the training loop pays for little more than the call.  The notebook reduces the
reports over all ranks (``engine/history.py``) and draws them
(``notebook/dashboard.py``).  Rank side: no IPython, ipywidgets or matplotlib
here.
"""
from __future__ import annotations

import threading
import time
from typing import Any

from ..wire import protocol
from ..wire.protocol import TOTAL_KEYS, format_record
from . import context, profiling, timing


PROGRESS_INTERVAL_S = 0.1  # at most ~10 progress events a second per rank
BATCH_WINDOW_S = 0.05  # reports that follow within this time travel in one message...
BUSY_BATCH_WINDOW_S = 0.5  # ...or within this one, while the last batch was busy (report() every step): the
BUSY_BATCH = 10  # last held this many reports or more.  The dashboard redraws at most twice a second anyway

_last_progress_sent = float("-inf")
_implicit_step = 0  # the x of reports that give neither epoch nor step


class _Axis:
    """Where this task's ``step`` axis stands.  A step counted within each epoch (``report(epoch=e, step=i)``, or
    ``report(step=i)`` alone) goes back at each new epoch: that starts a new pass, counted on from one past the last
    step sent, so that every pass keeps its records and the curve runs on.  A step goes back so when the epoch given
    with it changed, or, with no epoch given, when it is back at the task's first step or below; any other step
    that goes back (a validation reported at an earlier step) is sent as given."""

    __slots__ = ("first", "given", "epoch", "sent", "offset")

    def __init__(self):
        self.first = None  # the task's first step, as the user gave it
        self.given = float("-inf")  # the last step the user gave
        self.epoch = None  # the epoch given with it
        self.sent = float("-inf")  # the last step sent
        self.offset = 0  # added to the user's steps from the last time they went back

    def place(self, x, total, epoch):
        """The step and total to send for the user's step ``x``, ``total`` and ``epoch``, and (last step, ``x``) where
        ``x`` started a new pass."""
        went_back = None
        if self.first is None:
            self.first = x
        elif x < self.given and (epoch != self.epoch if epoch is not None else x <= self.first):
            went_back = (self.given, x)
            self.offset = self.sent + 1 - x
        self.given, self.epoch = x, epoch
        if self.offset:
            x += self.offset
            if total is not None:
                total += self.offset  # the passes so far and this one
        self.sent = x
        return x, total, went_back


_step_axis = _Axis()
_calls: list = []  # report()'s calls not yet taken by a batch: this task's list (see _Batch)
_queued: "_Batch | None" = None  # the batch in the sender's queue that has not yet taken the calls, if any
_window_s = BATCH_WINDOW_S  # the next batch's
_hurry = threading.Event()  # set: the batch being waited on leaves at once (the task ends)


class _Batch:
    """Reports queued for the sender thread as one ``metric`` event, which takes the calls made until it is sent.

    The sender thread pickles each event when its turn comes.  For a batch it
    first waits ``BATCH_WINDOW_S`` (the training loop goes on meanwhile and its
    reports join ``_calls``), then takes every call made so far, makes them into
    records (their steps placed on the task's axis, in order) and packs them;
    a later report queues a new batch.  Once a batch holds ``BUSY_BATCH`` reports
    or more, the next waits ``BUSY_BATCH_WINDOW_S``, until one holds fewer.  So a loop reporting
    1,000 times a second wakes the sender and the notebook twice a second
    instead of 1,000 (four times a second cost the kernel's message handling a
    third more CPU), a lone report leaves within 50 ms, and none is left
    behind: a batch that has not taken the calls is in the sender's queue
    whenever ``report()`` returns on the thread that queued it (another thread's
    call may return as that thread queues it), and the worker flushes that queue
    at the task's end.  It arrives
    in the notebook as a plain ``{"reports": [...]}`` dict, alike reports packed in
    runs (``protocol.pack_reports``), with ``rank_stats`` (``timing.take()``: where
    the rank's time went since the last batch, read as the batch is made, off the
    training loop) when its loader timed batches meanwhile.

    What the training loop pays for is an append to ``_calls``, with no lock: a
    task's list is not replaced while the task runs, and the sender takes calls
    from its front (``del calls[:n]``) while appends go to its end, each one step
    under the GIL.  A call that comes after the batch stopped waiting and before
    it took the calls queues another batch that may find none: it is sent with
    no reports, which the notebook passes over.  Each task has its own list and
    axis (``begin_task``): a batch of the last task still queued as the next one
    starts takes only the last task's calls.
    """

    __slots__ = ("axis", "calls", "made")

    def __init__(self, axis: _Axis, calls: list):
        self.axis = axis  # the task's step axis, which the calls' steps are placed on, in order, by this thread
        self.calls = calls  # the task's calls, which this batch takes from
        self.made = None  # what the batch pickles as, once made (its steps are placed on the axis once)

    def __reduce__(self):
        global _window_s, _queued
        if self.made is not None:
            return self.made
        _hurry.wait(_window_s)
        if _queued is self:
            _queued = None  # (before taking: a call from now on queues the next batch)
        taken = len(self.calls)
        calls = self.calls[:taken]
        del self.calls[:taken]
        if taken:  # (a batch that found none says nothing of how busy the loop is)
            _window_s = BUSY_BATCH_WINDOW_S if taken >= BUSY_BATCH else BATCH_WINDOW_S
        fields = [("reports", protocol.pack_reports([_record(self.axis, call) for call in calls]))]
        rank_stats = timing.take()  # where this rank's time went since the last batch: once a batch, not a report
        if rank_stats is not None:
            fields.append(("rank_stats", rank_stats))
        self.made = (dict, (tuple(fields),))
        return self.made


class Sum:
    """Wrap a value to have the notebook add it over ranks instead of averaging it.

    ``report(epoch=e, samples_per_s=Sum(rate))`` plots the global throughput.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __repr__(self) -> str:
        return f"Sum({self.value!r})"


def _number(name: str, value: Any) -> float | int:
    if type(value) is float or type(value) is int:
        return value
    try:
        return float(value)  # bools, numpy scalars, one-element tensors
    except (TypeError, ValueError):
        shape = getattr(value, "shape", None)
        what = "None" if value is None else f"a {type(value).__name__}" + (
            f" of shape {tuple(shape)}: report its mean (.mean()) or one element of it" if shape is not None else "")
        raise TypeError(f"report({name}=...) takes a number or a one-element tensor, not {what}") from None


def _values(metrics: dict) -> tuple[dict, list]:
    """The reported values as numbers, and the names wrapped in :class:`Sum`."""
    values, summed = {}, []
    for name, value in metrics.items():
        if type(value) is Sum:
            summed.append(name)
            value = value.value
        values[name] = _number(name, value)
    return values, summed


def report(*, epoch: float | None = None, step: float | None = None, epochs: int | None = None,
           steps: int | None = None, n: float | None = None, **metrics: Any) -> None:
    """Send metrics to the notebook, where they are reduced over all ranks and drawn live.

    ``epoch`` or ``step`` is the x axis (without either, each call is the next
    step); ``epochs``/``steps`` is the total, for the ETA; ``n`` (samples behind
    the numbers) weights the mean over ranks; wrap a value in :class:`Sum` to add
    it over ranks instead.  Outside a job it prints one line and does nothing else.
    """
    global _implicit_step
    if profiling.steps_by_calls:
        profiling.step()  # (a --profile window counts report() calls where no loader counts batches)
    summed = None
    for value in metrics.values():
        if type(value) is not float and type(value) is not int:  # (plain numbers: the keywords' own dict is sent)
            values, summed = _values(metrics)
            break
    else:
        values = metrics
    # (each number read by _number unless a plain int or float already: the call is the training loop's)
    if step is not None:
        key, total = "step", steps
        x = step if type(step) is int or type(step) is float else _number("step", step)
        _implicit_step = x  # (the user's numbering)
        if epoch is not None:
            epoch = _number("epoch", epoch)
    elif epoch is not None:
        key, total = "epoch", epochs
        x = epoch if type(epoch) is int or type(epoch) is float else _number("epoch", epoch)
    else:
        key, x, total = "step", _implicit_step + 1, steps
        _implicit_step = x
    if total is not None and type(total) is not int and type(total) is not float:
        total = _number(TOTAL_KEYS[key], total)  # (a tensor kept as given would be added to when a pass starts)
    if n is not None:
        n = _number("n", n)
    ctx = context.current()
    if ctx is None or ctx.sender is None:
        if ctx is None or ctx.rank == 0:  # under plain torchrun, one line per job is enough
            record = {key: x, **values}
            if total is not None:
                record[TOTAL_KEYS[key]] = total
            if key == "step" and epoch is not None:
                record["epoch"] = epoch
            print(format_record(record))
        return
    # What the loop pays for: the call, kept as given; the record is made by the sender thread (_record).
    sender = ctx.sender
    if sender.broken:  # (the notebook is gone: a batch would never be sent, nor take the calls)
        return
    _calls.append((key, x, total, epoch, n, summed, values))
    if _queued is None:
        _queue_batch(sender)


def _record(axis: _Axis, call: tuple) -> dict:
    """The record a ``report()`` call sends, its step placed on the task's axis (the sender thread, in order)."""
    key, x, total, epoch, n, summed, values = call
    body: dict[str, Any] = {"key": key, "x": x, "values": values}
    went_back = None
    if key == "step":
        body["x"], total, went_back = axis.place(x, total, epoch)
    if total is not None:
        body["total"] = total
    if n is not None:
        body["n"] = n
    if summed:
        body["sum"] = summed
    if key == "step" and epoch is not None:
        body["epoch"] = epoch
    if went_back is not None:
        body["went_back"] = went_back
    return body


def begin_task() -> None:
    """A task starts: its reports' steps start afresh (a warm pool's rank runs one task after another)."""
    global _implicit_step, _step_axis, _queued, _calls
    _implicit_step = 0
    _step_axis = _Axis()
    _calls = []  # (a call of the last task's from a thread still running is left to that task's batch, or dropped)
    _queued = None


def _queue_batch(sender) -> None:
    """Queue a batch to take the calls made from now on (``report()``, when none is queued)."""
    global _queued
    _queued = batch = _Batch(_step_axis, _calls)
    _hurry.clear()
    sender.send(protocol.METRIC, batch)


def hurry() -> None:
    """Send the reports waiting in a batch now, not at the end of its window: the task has ended."""
    _hurry.set()


def progress(done: int, total: int) -> None:
    """Progress inside an epoch (``done`` of ``total`` batches), for the dashboard's bar.

    Throttled here, in the rank: calls closer together than 0.1 s are dropped,
    except the last one (``done >= total``).  Does nothing outside a job.
    """
    global _last_progress_sent
    profiling.step()
    now = time.monotonic()
    if done < total and now - _last_progress_sent < PROGRESS_INTERVAL_S:
        return
    _last_progress_sent = now
    context.send(protocol.PROGRESS, {"done": done, "total": total})
