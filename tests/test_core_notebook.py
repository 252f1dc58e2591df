"""The %%ddp magic in real Jupyter kernels: results, errors, interrupt and a killed kernel."""
import os
import re
import signal
import time

import psutil
import pytest

from nbrun import error, gone, kernel, run_cells, run_until_pids, text

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.kernel]

SETUP = '''import torch
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
    def forward(self, x):
        return self.lin(x)
def broken(x):
    y = x + 1
    raise ValueError(f"broken with {y}")
scale = 3
rank = "the notebook's rank"'''


def test_magic_end_to_end_in_a_kernel(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        SETUP,
        # 2: names come from the notebook, results come back from rank 0
        '''%%ddp --cpus 2 --seed 7 --return total,model,draws
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
total = torch.ones(2) * (rank + 1) * scale
dist.all_reduce(total)
model = DDP(Net())
draws = torch.rand(3)
gathered = [torch.zeros(3) for _ in range(world_size)]
dist.all_gather(gathered, draws)
assert torch.equal(gathered[0], gathered[1])
print("on", rank, "of", world_size, device)''',
        "print(total.tolist(), type(model).__name__, model(torch.ones(1, 3)).shape, draws.shape)",
        # 4: a failure in a function from an earlier cell: rank traceback with the cells' own lines
        '''%%ddp --cpus 2
import torch.distributed as dist
if rank == 1:
    broken(41)
dist.all_reduce(torch.ones(1))''',
        "%%ddp --cpus 2\nx = (",
        "import threading\nlock = threading.Lock()",
        "%%ddp --cpus 2\nwith lock:\n    pass",
        "%%ddp --cpus 2 --gpus 1\npass",
        "%%ddp --cpus two\npass",
        "%%ddp --gpus 99\npass",
        "%%ddp --cpus 2 --output 0\nprint('only from', rank)",
        "%%ddp --cpus 2 --return missing,x\nx = 1\nif rank > 5:\n    missing = 2",
        "print('kernel still fine', x)",
    ])
    cells = nb.cells
    out = text(cells[2])
    assert "[rank 0] on 0 of 2 cpu" in out and "[rank 1] on 1 of 2 cpu" in out
    assert "'rank' is the rank's own" in out  # the notebook's `rank` is shadowed, with a warning
    assert text(cells[3]).startswith("[9.0, 9.0] Net torch.Size([1, 1]) torch.Size([3])")

    err = error(cells[4])
    assert err.ename == "RankError"
    shown = "\n".join(err.traceback)
    assert "rank 1 failed: ValueError: broken with 42" in shown
    assert f'File "Cell In[{cells[4].execution_count}]", line 4, in <module>' in shown
    assert "    broken(41)" in shown
    assert f'File "Cell In[{cells[1].execution_count}]", line 10, in broken' in shown
    assert 'raise ValueError(f"broken with {y}")' in shown
    assert "ddp_notebook" not in shown.replace("%%ddp", "")  # no launcher frames
    assert "Connection closed" not in shown

    assert re.search(r"UsageError: SyntaxError in Cell In\[\d+\], line 2: '\(' was never closed", text(cells[5]))
    assert "cannot send 'lock' (lock) to the ranks" in text(cells[7])
    assert "UsageError: give either gpus or cpus, not both" in text(cells[8])
    assert "UsageError" in text(cells[9]) and "two" in text(cells[9])
    assert "UsageError: 99 GPUs asked for, but this machine has 0" in text(cells[10])
    for refused in cells[5], cells[7], cells[8], cells[9], cells[10]:
        assert "[rank" not in text(refused)
    assert text(cells[11]) == "[rank 0] only from 0\n"
    assert "UsageError: --return: the cell never assigned missing on any rank; x copied back" in text(cells[12])
    assert text(cells[13]) == "kernel still fine 1\n"  # the other returned name still arrived


LONG_CELL = '''%%ddp --cpus 2
import os, time
import torch, torch.distributed as dist
print("PID", os.getpid(), flush=True)
for step in range(100000):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.01)'''


def test_interrupt_stops_every_rank_and_keeps_the_kernel(no_leftovers):
    with kernel() as (km, kc):
        for _ in range(2):
            msg_id, pids = run_until_pids(kc, LONG_CELL)
            interrupted = time.time()
            km.interrupt_kernel()
            reply = kc.get_shell_msg(timeout=30)
            assert reply["parent_header"]["msg_id"] == msg_id
            assert reply["content"]["status"] == "error"
            assert reply["content"]["ename"] == "KeyboardInterrupt"
            assert gone(pids, 5), "ranks survived the interrupt"
            kernel_process = psutil.Process(km.provisioner.process.pid)
            assert [c for c in kernel_process.children() if c.status() == psutil.STATUS_ZOMBIE] == []
            assert time.time() - interrupted < 10
        reply = kc.execute_interactive("print(6 * 7)", timeout=30)
        assert reply["content"]["status"] == "ok"


def test_ranks_exit_when_the_kernel_is_killed(no_leftovers):
    with kernel() as (km, kc):
        _, pids = run_until_pids(kc, LONG_CELL)
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert gone(pids, 10), "ranks outlived the kernel"
