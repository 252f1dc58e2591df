"""Restarts (``--max-restarts``): a failed attempt is run again on fresh ranks and resumes from its checkpoint."""
import textwrap

import pytest

import ddp_notebook
from ddp_notebook import RankError
from ddp_notebook.wire.errors import LaunchError
from conftest import rank_processes
from nbrun import execute, kernel

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _train(checkpoint, epochs, kill_at_epoch, sharded=False, background=False):
    """A seeded 2-rank DDP (or FSDP2, ``sharded``) loop with dropout (every rank's RNG matters) that checkpoints
    each epoch (``background``: written in the background); rank 1 kills itself with SIGKILL in the middle of
    ``kill_at_epoch`` of attempt 0 (None: no fault)."""
    import os
    import signal

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_notebook

    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(64, 1, generator=torch.Generator().manual_seed(2)))
    loader = ddp_notebook.distributed_loader(data, batch_size=8, shuffle=True)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    if sharded:
        from torch.distributed.fsdp import fully_shard

        fully_shard(net[0])
        model = fully_shard(net)
    else:
        model = DDP(net)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    start = ddp_notebook.resume(checkpoint, model, optimizer, loader)
    for epoch in range(start, epochs):
        total = torch.zeros(1)
        for batch, (x, y) in enumerate(loader):
            if epoch == kill_at_epoch and batch == 2 and dist.get_rank() == 1 and ddp_notebook.attempt() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if epoch == kill_at_epoch and batch == 1 and background:  # (the last epoch's save is whole by the kill)
                ddp_notebook.load_checkpoint(checkpoint)
                dist.barrier()
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        ddp_notebook.report(epoch=epoch, loss=float(total), epochs=epochs)
        ddp_notebook.save_checkpoint(checkpoint, model, optimizer, epoch, loader=loader, background=background)
    if sharded:
        weights = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        weights = {k: v.clone() for k, v in model.module.state_dict().items()}
    return {"attempt": ddp_notebook.attempt(), "start": start, "weights": weights}


@pytest.mark.parametrize("sharded,background", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["ddp", "fsdp2", "ddp-background-saves", "fsdp2-background-saves"])
def test_a_killed_rank_restarts_and_resumes_to_the_same_weights_bit_for_bit(tmp_path, sharded, background,
                                                                             no_leftovers):
    clean = ddp_notebook.launch(_train, (str(tmp_path / "clean.pt"), 6, None, sharded), cpus=2, seed=7)
    faulted = ddp_notebook.launch(_train, (str(tmp_path / "faulted.pt"), 6, 3, sharded, background), cpus=2,
                                  seed=7, max_restarts=1)
    job = ddp_notebook.last_job()
    assert [r["attempt"] for r in faulted] == [1, 1]
    assert [r["start"] for r in faulted] == [3, 3]  # the checkpoint of epoch 2 was the last one saved
    for rank in range(2):
        for name, value in clean[rank]["weights"].items():
            assert value.dtype == faulted[rank]["weights"][name].dtype
            assert value.equal(faulted[rank]["weights"][name]), f"rank {rank}: {name} differs"
    assert len(job.attempts) == 1 and job.attempts[0]["cause"] == "rank 1 died (SIGKILL)"
    history = job.history
    assert [record["epoch"] for record in history] == [0, 1, 2, 3, 4, 5]  # one record per epoch
    assert history.attempts == [{"attempt": 0, "cause": "rank 1 died (SIGKILL)", "at": {"epoch": 3}}]
    assert rank_processes() == []


def _always_fails(message):
    import torch.distributed as dist

    import ddp_notebook

    if dist.get_rank() == 1:
        raise ValueError(f"{message} in attempt {ddp_notebook.attempt()}")
    dist.barrier()


def test_when_restarts_run_out_the_error_lists_every_attempt(no_leftovers):
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_always_fails, ("bad data",), cpus=2, max_restarts=2)
    text = str(info.value)
    assert text.startswith("every attempt failed (restarts used up: 2); earlier attempts:\n"
                           "  attempt 1: rank 1 failed: ValueError: bad data in attempt 0\n"
                           "  attempt 2: rank 1 failed: ValueError: bad data in attempt 1\n"
                           "attempt 3, the last: rank 1 failed: ValueError: bad data in attempt 2"), text
    assert info.value.rank == 1 and 'raise ValueError(f"{message} in attempt' in info.value.failure.traceback


def test_restart_options_are_checked_before_anything_starts():
    with pytest.raises(LaunchError, match="max_restarts must be a non-negative integer, not -1"):
        ddp_notebook.launch(_always_fails, ("x",), cpus=2, max_restarts=-1)
    with pytest.raises(LaunchError, match="torchrun --max-restarts"):
        ddp_notebook.launch(_always_fails, ("x",), cpus=2, max_restarts=1, nnodes=2, master_addr="127.0.0.1")


def test_a_cell_on_the_warm_pool_restarts_on_fresh_ranks():
    with kernel() as (km, kc):
        execute(kc, ["%ddp_start --cpus 2", "import torch\nscale = torch.tensor(2.0)",
                     "%%ddp\nw = scale * 1"])  # the pool's ranks hold `scale` now
        show_pids = "from ddp_notebook.engine import pool\nprint(sorted(pool.current().group.pids.values()))"
        pids_before = execute(kc, [show_pids])
        out = execute(kc, [textwrap.dedent("""\
            %%ddp --max-restarts 1 --return seen
            import os, signal, torch, torch.distributed as dist, ddp_notebook
            total = torch.tensor([float(ddp_notebook.attempt())]) * scale
            if rank == 1 and ddp_notebook.attempt() == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(total)
            seen = (ddp_notebook.attempt(), float(total))
            """)])
        assert "rank 1 died (SIGKILL) — attempt 2 of 2" in out, out
        assert "Traceback" not in out, out
        # attempt 1 on both ranks, with `scale` shipped again to the fresh ranks: (1 + 1) * 2
        assert execute(kc, ["print(seen)"]).strip() == "(1, 4.0)"
        assert execute(kc, [show_pids]) != pids_before
        status = execute(kc, ["%ddp_status"])
        assert "1 restarts" in status and "alive" in status and "DEAD" not in status
        assert execute(kc, ["%%ddp\nprint('still warm', seen)"]).count("still warm") == 2
        execute(kc, ["%ddp_stop"])
