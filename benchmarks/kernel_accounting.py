"""Where the kernel's CPU goes during jobs (for ``bench_report.py --kernel-setup``; not a test).

Run in the kernel after ``%load_ext ddp_notebook``; at each job's end it appends one JSON line to
``$DDP_NOTEBOOK_KERNEL_ACCOUNTING`` (default ``kernel_accounting.jsonl``): the process's CPU time since the setup
and the CPU time (``time.thread_time``, the calling thread's) spent in the dashboard's and the engine's main steps,
cumulative; the difference between two lines is one job's.

    .venv/bin/python benchmarks/bench_report.py --mlp --mlp-steps 6000 --mlp-pairs 1 --long-steps 0 \\
        --kernel-setup "exec(open('benchmarks/kernel_accounting.py').read())"
"""
import functools
import json
import os
import time

import psutil

from ddp_notebook.engine import backend
from ddp_notebook.engine import job as engine_job
from ddp_notebook.engine import metrics
from ddp_notebook.notebook import dashboard

_spent: dict[str, float] = {}
_calls: dict[str, int] = {}
_process = psutil.Process()
_cpu_at_setup = sum(_process.cpu_times()[:2])


def _account(cls, name: str, label: str) -> None:
    original = getattr(cls, name)

    @functools.wraps(original)
    def accounted(*args, **kwargs):
        started = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            _spent[label] = _spent.get(label, 0.0) + time.thread_time() - started
            _calls[label] = _calls.get(label, 0) + 1

    setattr(cls, name, accounted)


_account(engine_job.Job, "_pump", "main thread: the job's pump (receiving, dispatching, all below)")
_account(backend.ChannelRanks, "read_connection", "main thread: read a rank's messages and dispatch them")
_account(metrics.Metrics, "_reports", "main thread: the job's metrics (reduce, forward, curves)")
_account(dashboard.Watcher, "metrics_updated", "main thread: the dashboard's curves")
_account(dashboard.Reducer, "add_many", "main thread: Reducer.add_many")
_account(dashboard.DisplayView, "refresh", "drawing thread: status and figure")
_account(dashboard.Plot, "render", "drawing thread: Plot.render (the figure, its PNG)")
_ended = metrics.Metrics._ended


def _ended_and_written(self):
    result = _ended(self)
    line = {"process_cpu_s": sum(_process.cpu_times()[:2]) - _cpu_at_setup,
            **{label: [round(seconds, 4), _calls[label]] for label, seconds in _spent.items()}}
    with open(os.environ.get("DDP_NOTEBOOK_KERNEL_ACCOUNTING", "kernel_accounting.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")
    return result


metrics.Metrics._ended = _ended_and_written
