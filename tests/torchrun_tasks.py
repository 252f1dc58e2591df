"""What the torchrun tests export: a module of its own, so the ranks that import it import nothing heavy."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fails_on_node_1():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("node one is broken")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


def with_arrays(table, grid):
    import numpy as np
    import torch

    from ddp_notebook import rank_context, report

    maps = open("/proc/self/maps").read()
    report(step=1, total=float(table.sum()), corner=float(grid[-1, -1]), cwd_is_elsewhere=os.getcwd() != ROOT,
           mapped=maps.count("with_arrays.arrays.bin") > 0, world=rank_context().world_size)
    assert isinstance(table, torch.Tensor) and isinstance(grid, np.ndarray)
    return table.shape


def nothing():
    return None


def sleeps():
    import time

    print(f"PID {os.getpid()}", flush=True)
    time.sleep(120)


def reports_then_rank_1_fails():
    from ddp_notebook import rank_context, report

    ctx = rank_context()
    report(epoch=1, loss=float(ctx.rank), local=ctx.local_rank)
    if ctx.rank == 1:
        raise ValueError("rank one is broken")


def one_asleep_before_all_reduce():
    import time

    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 1:
        time.sleep(90)  # ASLEEP
    dist.all_reduce(torch.ones(1))


def reports_three_steps():
    from ddp_notebook import rank_context, report

    for step in range(3):
        report(step=step, steps=3, loss=float(rank_context().rank + step))
    return rank_context().rank
