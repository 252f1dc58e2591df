"""The per-rank view: where each rank's time per batch goes, and which rank the others wait for."""
import pytest

import ddp_notebook

pytestmark = pytest.mark.slow


def _rank_1_straggles():
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    from ddp_notebook import distributed_loader, report

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def forward(self, x):
            if dist.get_rank() == 1:
                time.sleep(0.05)
            return self.layer(x)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(192, 4), torch.randn(192, 1))
    loader = distributed_loader(data, batch_size=8)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(1, 3):
        for x, y in loader:
            loss = ((model(x) - y) ** 2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        report(epoch=epoch, epochs=2, loss=loss.item())


@pytest.mark.timeout(90)
def test_the_rank_that_sleeps_in_forward_is_named_as_the_straggler(no_leftovers):
    ddp_notebook.launch(_rank_1_straggles, cpus=2)
    job = ddp_notebook.last_job()
    ranks = job.ranks
    assert [sorted(own["loss"]) for own in job.history.by_rank] == [[0, 1], [0, 1]]  # each rank's own loss
    assert sorted(ranks) == [0, 1]
    assert [ranks[r]["batches"] for r in (0, 1)] == [22, 22]  # 12 batches an epoch, the first of each not timed
    # Rank 0 waits in the all-reduce for rank 1's extra 50 ms; rank 1 hardly waits.
    assert ranks[0]["comm_wait"] > ranks[1]["comm_wait"] + 0.3, ranks
    assert all(0 < ranks[r]["samples_per_s"] < 8 / 0.05 and ranks[r]["memory"] > 10 * 2**20 for r in (0, 1))
    assert ranks[0]["memory_kind"] == "resident"
    straggler, line = ranks.straggler()
    assert straggler == 1
    assert line.startswith("rank 1: the others wait ") and "rank 0" not in line
    panel = ranks.lines()
    assert panel[0].startswith("rank 0: ") and "samples/s · data wait " in panel[0]
    assert panel[-1] == "straggler: " + line
