"""Where a rank's time per batch goes: waiting for data, computing, waiting for the other ranks.

Measured without user code: :class:`~.data.DistributedLoader` times each batch
(the wait inside ``next()`` is the data wait, the time between two batches the
whole step), and when the model is wrapped in ``DistributedDataParallel`` a
communication hook (DDP's default all-reduce, timed) measures how long this
rank's gradients wait in the all-reduce for the others.  Under DDP every rank's
step lasts as long as the slowest one's: the straggler is the rank the others wait
for.  The totals since the last batch of reports ride on the next batch (its
``rank_stats``, read by the sender thread as it makes the batch); nothing else is sent.
"""
from __future__ import annotations

import threading
import time
import weakref

_lock = threading.Lock()
_totals = {"batches": 0, "samples": 0, "step_s": 0.0, "data_s": 0.0, "comm_s": 0.0}
_step_comm = 0.0  # the longest all-reduce wait of the step under way (buckets overlap: not their sum)
_hooked: "weakref.WeakSet" = weakref.WeakSet()  # DDP models that carry the timed hook (or could not)
_wanted = False  # a loader times batches: time the DDP all-reduce too


def batch_done(data_s: float, step_s: float, samples: int) -> None:
    """One batch of a loader: its data wait and its whole step (data wait included)."""
    global _step_comm
    with _lock:
        _totals["batches"] += 1
        _totals["samples"] += samples
        _totals["data_s"] += data_s
        _totals["step_s"] += step_s
        _totals["comm_s"] += _step_comm
        _step_comm = 0.0


def _comm_waited(seconds: float) -> None:
    global _step_comm
    with _lock:
        _step_comm = max(_step_comm, seconds)


def reset() -> None:
    """Forget what was timed (a new task starts: an earlier cell's batches are not its)."""
    global _step_comm, _wanted
    with _lock:
        for name in _totals:
            _totals[name] = 0 if name in ("batches", "samples") else 0.0
        _step_comm = 0.0
    _wanted = False


def take() -> dict | None:
    """The totals since the last call, with this rank's memory; None when no batch was timed."""
    if not _totals["batches"]:  # (read without the lock: report() calls this every step; a batch counted meanwhile
        return None  # rides on the next report)
    with _lock:
        if not _totals["batches"]:
            return None
        stats = dict(_totals)
        for name in _totals:
            _totals[name] = 0 if name in ("batches", "samples") else 0.0
    stats["memory"], stats["memory_kind"] = _memory()
    return stats


def _memory() -> tuple[int, str]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated()), "cuda peak allocated"
    import psutil

    return int(psutil.Process().memory_info().rss), "resident"


def watch_ddp() -> None:
    """Time the all-reduce of the DDP models this rank runs (called as a loader starts an epoch)."""
    global _wanted
    _wanted = True


def time_allreduce(model) -> None:
    """Called before each forward of a DDP model (``rank/replicas.py``): time its all-reduce once a loader asked."""
    if not _wanted or model in _hooked:
        return
    _hooked.add(model)
    try:
        model.register_comm_hook(model.process_group, _timed_allreduce)
    except RuntimeError:
        pass  # a hook of the user's, or training already under way: no all-reduce timing for this model


def _timed_allreduce(process_group, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    started = time.perf_counter()

    def waited(future):
        _comm_waited(time.perf_counter() - started)
        return future.value()

    return allreduce_hook(process_group, bucket).then(waited)
