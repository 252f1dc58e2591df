"""Rank side of ``%%ddp --profile``: torch.profiler over a window of the task's steps, its trace sent to the notebook.

A step is a ``distributed_loader`` batch (``rank/data.py``), or, in a task that
iterates no such loader, a ``report()``/``progress()`` call (``rank/metrics.py``):
both call :func:`step`, so a cell needs no profiler code.  The loader also marks
its wait for the next batch (:func:`data_wait`: a ``ddp_notebook:data`` range in
the trace), which the notebook counts as data loading.  A task without
``--profile`` never starts a profiler: :func:`step` and :func:`data_wait` only
read a module global then.

The window: ``skip`` steps are left out (warm-up: DDP's first buckets, the
loader's workers), one more warms the profiler up, then ``steps`` are recorded.
At the task's end the Chrome trace goes to the notebook as one ``PROFILE``
message (gzip), with this rank's wall clock offset to the notebook's.
"""
from __future__ import annotations

import contextlib
import gzip
import os
import socket
import sys
import tempfile
import time

from ..wire import protocol

DATA_RANGE = "ddp_notebook:data"  # the loader's wait for its next batch, as named in the trace

_profiler = None  # the running torch.profiler.profile of this task, or None (no --profile)
_trace: bytes | None = None  # the window's Chrome trace, once it has ended early (a cell's own profiler started)
_original_prepare = None  # torch.autograd.profiler.profile._prepare_trace while ours runs (see _give_way_to_others)
_steps_from_loader = False  # a loader steps the window: report() and progress() leave it alone
_clock_offset_ns = 0
steps_by_calls = False  # a window runs that report() and progress() move on (report() reads it: no function call)


def start(options: dict, cuda: bool = False) -> None:
    """Profile this task's steps as ``options`` say: ``{steps, skip, clock_ns, host}`` (``RUN``'s ``profile``);
    ``cuda``: the rank's device is a GPU (its kernels are recorded too).

    ``clock_ns`` is the notebook's ``time.time_ns()`` as it sent the task; on another host than the notebook's,
    its difference to this rank's clock (message latency included) aligns this rank's trace."""
    global _profiler, _steps_from_loader, _clock_offset_ns, _trace, steps_by_calls
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    stop()
    _trace = None
    _clock_offset_ns = 0 if options.get("host") == socket.gethostname() else options["clock_ns"] - time.time_ns()
    _steps_from_loader = False
    activities = [ProfilerActivity.CPU]
    if cuda and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    _profiler = profile(activities=activities, record_shapes=False, with_stack=False,
                        schedule=schedule(skip_first=options["skip"], wait=0, warmup=1, active=options["steps"],
                                          repeat=1),
                        on_trace_ready=_keep_trace)
    _profiler.trace = None
    _give_way_to_others()
    _profiler.start()
    steps_by_calls = True


def _give_way_to_others() -> None:
    """A cell's own torch.profiler, started while ours runs, ends our window there (with what it recorded) and runs
    as it would alone: torch has one profiling session per process, and a second one started over ours would leave
    ours pointing at a session that is gone."""
    global _original_prepare
    from torch.autograd import profiler as autograd_profiler

    original = _original_prepare or autograd_profiler.profile._prepare_trace

    def prepare_trace(self):
        if _profiler is not None and self is not getattr(_profiler, "profiler", None):
            _end_window_early()
        return original(self)

    _original_prepare = original
    autograd_profiler.profile._prepare_trace = prepare_trace


def _end_window_early() -> None:
    global _trace
    _trace = stop()


def _keep_trace(prof) -> None:
    """The window is over (called by the profiler from the step that ends it): keep its Chrome trace."""
    fd, path = tempfile.mkstemp(prefix="ddp_notebook_trace_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, "rb") as f:
            prof.trace = f.read()
    except Exception as exc:  # noqa: BLE001 - the cell goes on without this rank's trace
        print(f"ddp_notebook: --profile: this rank's trace could not be exported: {exc}", file=sys.stderr)
    finally:
        os.unlink(path)


def step_by_loader() -> None:
    """A loader starts an epoch: from now on its batches are the steps, not ``report()`` or ``progress()``."""
    global _steps_from_loader, steps_by_calls
    _steps_from_loader = True
    steps_by_calls = False


def step(from_loader: bool = False) -> None:
    """One step of the task: the window moves on (a loader's batch; else a ``report()`` or ``progress()``)."""
    if _profiler is None or (_steps_from_loader and not from_loader):
        return
    from torch.autograd import profiler as autograd_profiler
    from torch.profiler import ProfilerAction

    if _profiler.current_action == ProfilerAction.NONE and autograd_profiler._is_profiler_enabled:
        _end_window_early()  # a profiler of the cell's own runs: ours does not start over it
        return
    _profiler.step()


def data_wait():
    """A context around a loader's wait for its next batch: a ``ddp_notebook:data`` range while profiling."""
    if _profiler is None:
        return contextlib.nullcontext()
    from torch.profiler import record_function

    return record_function(DATA_RANGE)


def stop() -> bytes | None:
    """End this task's profiling; the Chrome trace (JSON) of the window, or None (no step reached it)."""
    global _profiler, _original_prepare, steps_by_calls
    prof, _profiler = _profiler, None
    steps_by_calls = False
    if prof is None:
        return None
    if _original_prepare is not None:
        from torch.autograd import profiler as autograd_profiler

        autograd_profiler.profile._prepare_trace = _original_prepare
        _original_prepare = None
    try:
        prof.stop()  # (a window cut short by the task's end is exported here)
    except Exception:  # noqa: BLE001 - a cell's own profiler took over the session: no trace of ours
        return None
    return prof.trace


def finish(sender, task_id) -> None:
    """End profiling and send the window's trace to the notebook (``PROFILE``; an empty one when none was taken)."""
    global _trace
    if _profiler is None and _trace is None:
        return
    trace = stop() or _trace
    _trace = None
    if sender is None:
        return  # (no notebook: an exported script's ranks under plain torchrun)
    sender.send(protocol.PROFILE, {"task": task_id, "offset_ns": _clock_offset_ns,
                                   "trace": gzip.compress(trace, 1) if trace else None})


def active() -> bool:
    """Whether this rank profiles its task now."""
    return _profiler is not None
