"""The notebook keeps working while a job runs: every value it writes is kept, and the ranks of a job that runs
beside it (a background job) see its big arrays as they were at launch."""
from __future__ import annotations

import socket
import time

import pytest
import torch

import ddp_notebook
from ddp_notebook.wire import sharing
from nbrun import execute, kernel

pytestmark = pytest.mark.slow  # the kernel test is marked too

MIB = 1 << 20


def _sum_at_start(x):
    total = float(x.sum())  # what this rank was given
    time.sleep(0.5)
    return total


def test_a_background_job_keeps_every_write_the_notebook_makes_while_it_starts(no_leftovers):
    for _ in range(3):
        x = torch.zeros(128 * MIB // 4)
        job = ddp_notebook.launch(_sum_at_start, args=(x,), cpus=2, background=True)
        for _ in range(5):
            x.add_(1.0)  # while the job starts and runs
        seen = job.wait()
        assert torch.unique(x).tolist() == [5.0]
        assert seen == [0.0, 0.0]  # a snapshot as of the launch


class _Chunks(torch.utils.data.Dataset):
    def __init__(self, x, count):
        self.x, self.count = x, count

    def __len__(self):
        return self.count

    def __getitem__(self, i):
        step = len(self.x) // self.count
        return self.x[i * step:(i + 1) * step].clone()


def test_a_fork_of_the_notebook_while_a_background_job_runs(no_leftovers):
    x = torch.zeros(64 * MIB // 4)
    job = ddp_notebook.launch(_sum_at_start, args=(x,), cpus=2, background=True)
    for epoch in range(3):
        loader = torch.utils.data.DataLoader(_Chunks(x, 8), batch_size=None, num_workers=2)
        batches = list(loader)  # the workers are forks of the notebook
        assert all(torch.unique(b).tolist() == [float(epoch)] for b in batches)
        x.add_(1.0)
    assert job.wait() == [0.0, 0.0]
    assert torch.unique(x).tolist() == [3.0]


def test_a_job_that_cannot_start_returns_only_once_its_data_is_in_place(no_leftovers):
    x = torch.zeros(512 * MIB // 4)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(ddp_notebook.LaunchError, match="in use"):
            ddp_notebook.launch(_sum_at_start, args=(x,), cpus=2, port=taken.getsockname()[1])
    finally:
        taken.close()
    assert sharing.settle(0)  # no move is left running beside the notebook's next cell
    x.add_(1.0)
    assert torch.unique(x).tolist() == [1.0]


POOL_CELLS = '''
import time, torch, ddp_notebook
def first_value(x):
    v = float(x[0])
    time.sleep(0.5)
    return v
results = []
for _ in range(3):
    x = torch.zeros(64 * 2**20)
    job = ddp_notebook.launch(first_value, args=(x,), background=True)
    for _ in range(5):
        x.add_(1.0)
    results.append((torch.unique(x).tolist(), job.wait()))
print("launch:", results)
'''


@pytest.mark.kernel
def test_background_jobs_on_the_warm_pool_keep_every_write(no_leftovers):
    with kernel() as (km, kc):
        text = execute(kc, ["%ddp_start --cpus 2", POOL_CELLS, "y = torch.zeros(64 * 2**20)",
                            "%%ddp --background --return seen\nseen = float(y[0]); time.sleep(0.5)",
                            "for _ in range(5): y.add_(1.0)\n"
                            "ddp_notebook.last_job().wait()\n"
                            "print('cell:', torch.unique(y).tolist(), seen)", "%ddp_stop"])
    assert "launch: [([5.0], [0.0, 0.0]), ([5.0], [0.0, 0.0]), ([5.0], [0.0, 0.0])]" in text, text
    assert "cell: [5.0] 0.0" in text, text
