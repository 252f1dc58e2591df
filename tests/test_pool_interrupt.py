"""A warm pool after an interrupt that leaves the ranks' process group out of step (gpu-review item 6).

NCCL enqueues a collective and returns: an interrupted rank can leave one that no other rank matched, and the next
cell's collectives pair with it.  Gloo does the same with ``async_op=True``, so the CPU shows it: rank 1 starts an
all_reduce that rank 0 never joins, both are interrupted back at Python, both answer and the TCPStore check passes.
"""
import os
import re
import signal
import sys
import threading
import time

import pytest

import ddp_notebook
from ddp_notebook.engine import pool
from ddp_notebook.engine import spec as job_spec

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def _pid():
    import os

    return os.getpid()


def _leaves_a_collective_unmatched(marks: str):
    import os
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:  # started, not waited for: on NCCL every collective is like this
        dist.all_reduce(torch.full((1,), 100.0), async_op=True)
    open(os.path.join(marks, str(rank)), "w").close()
    time.sleep(3600)  # rank 0 is interrupted before it reaches its all_reduce


def _sum_of_ranks_plus_one():
    import torch
    import torch.distributed as dist

    t = torch.full((1,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t.item()


def _interrupt_when(paths, timeout=60.0):
    """SIGINT to this (the notebook's) main thread once every path exists, as Jupyter's stop button does."""
    main = threading.main_thread().ident

    def watch():
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)  # the ranks are in their sleep
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()


def test_an_interrupt_that_leaves_a_collective_unmatched_restarts_the_pool(tmp_path, capfd, no_leftovers):
    warm = pool.Pool(job_spec.resolve_devices(cpus=2)).start()
    try:
        before = set(ddp_notebook.launch(_pid))
        assert ddp_notebook.launch(_sum_of_ranks_plus_one) == [3.0, 3.0]
        capfd.readouterr()
        _interrupt_when([tmp_path / "0", tmp_path / "1"])
        with pytest.raises(KeyboardInterrupt):
            ddp_notebook.launch(_leaves_a_collective_unmatched, args=(str(tmp_path),))
        told = capfd.readouterr().err
        # One line says why.  Without the process group's check the store barrier passed and the pool said "the
        # warm pool's ranks are back and keep their state", leaving rank 1's stale all_reduce for the next cell's.
        # With it, rank 0's check pairs with the stale one: gloo aborts rank 1 (its 4-byte all_reduce gets the
        # check's 24 bytes), or the check fails or sums wrong; each is this message.
        said = [line for line in told.splitlines() if line.startswith("ddp_notebook:")]
        assert len(said) == 1, told
        assert re.match(r"ddp_notebook: after the interrupt the ranks' process group was out of step "
                        r"\(a collective one rank started was left unmatched\): .+; the warm pool was restarted "
                        r"and the names its ranks held are gone$", said[0]), said[0]
        assert warm.restarts == 1
        assert ddp_notebook.launch(_sum_of_ranks_plus_one) == [3.0, 3.0]
        assert not set(ddp_notebook.launch(_pid)) & before
    finally:
        warm.stop()
        sys.stderr.flush()


def _in_step_after_interrupt(marks: str):
    import os
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)  # finished on every rank: nothing is left pending
    open(os.path.join(marks, str(dist.get_rank())), "w").close()
    time.sleep(3600)


def test_an_interrupt_past_every_collective_keeps_the_pool(tmp_path, capfd, no_leftovers):
    warm = pool.Pool(job_spec.resolve_devices(cpus=2)).start()
    try:
        before = set(ddp_notebook.launch(_pid))
        capfd.readouterr()
        _interrupt_when([tmp_path / "0", tmp_path / "1"])
        with pytest.raises(KeyboardInterrupt):
            ddp_notebook.launch(_in_step_after_interrupt, args=(str(tmp_path),))
        told = capfd.readouterr().err
        assert "the warm pool's ranks are back and keep their state" in told and "restarted" not in told, told
        assert warm.restarts == 0
        assert ddp_notebook.launch(_sum_of_ranks_plus_one) == [3.0, 3.0]
        assert set(ddp_notebook.launch(_pid)) == before
    finally:
        warm.stop()
