"""Live metrics end to end: real ranks, a real kernel (nbclient), and plain launch() from a script."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from nbrun import run_cells, text

pytestmark = pytest.mark.slow  # the kernel test is marked too

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

TWO_RANKS = """\
%%ddp --cpus 2 --callback got.append --tensorboard {tensorboard}
import time
from ddp_notebook import report, progress
for epoch in range(1, 4):
    for batch in range(4):
        progress(batch, 4)
        time.sleep(0.1)
    progress(4, 4)
    report(epoch=epoch, epochs=3, loss=rank + 1)
    print(f"rank {{rank}} finished epoch {{epoch}}")
"""

QUIET = """\
%%ddp --cpus 2
print("nothing reported")
"""

# Rank r holds (r + 1) * 10 samples and reports loss r; rank 2 is slow.  Rank 0 alone
# reports "rank0_only"; every rank counts its samples as a sum.
THREE_RANKS = """\
%%ddp --cpus 3 --callback got3.append
import time
from ddp_notebook import report, Sum
for epoch in range(1, 4):
    if rank == 2:
        time.sleep(0.6)
    report(epoch=epoch, n=(rank + 1) * 10, loss=float(rank), samples=Sum((rank + 1) * 10))
    if rank == 0:
        report(epoch=epoch, rank0_only=5.0)
"""

# Rank 1 fails after two epochs: the dashboard still leaves its figure, marked failed, before the error.
FAILING = """\
%%ddp --cpus 2
import time
from ddp_notebook import report
for epoch in range(1, 4):
    report(epoch=epoch, epochs=3, loss=rank + 1)
    if rank == 1 and epoch == 2:
        raise ValueError("rank 1 gives up")
time.sleep(30)
"""

INSPECT = """\
import json, ddp_notebook
job = ddp_notebook.last_job()
job.history.to_csv({csv!r})
print("HISTORY", json.dumps(job.history))
print("GOT", json.dumps({got}))
"""


@pytest.mark.timeout(150)
@pytest.mark.kernel
def test_metrics_in_a_real_kernel(tmp_path, no_leftovers):
    tensorboard, csv_path = tmp_path / "tb", tmp_path / "history.csv"
    cells = [
        "%load_ext ddp_notebook\ngot, got3 = [], []",
        TWO_RANKS.format(tensorboard=tensorboard),
        INSPECT.format(csv=str(csv_path), got="got") + "job.show()",
        QUIET,
        THREE_RANKS,
        INSPECT.format(csv=str(tmp_path / "three.csv"), got="got3"),
        FAILING,
        INSPECT.format(csv=str(tmp_path / "failed.csv"), got="[]"),
    ]
    nb, client = run_cells(cells, timeout=120, cwd=str(tmp_path))
    for index, cell in enumerate(nb.cells):
        if index != 6:
            assert not [o for o in cell.outputs if o.output_type == "error"], text(cell)

    # 2 ranks, loss = rank + 1: every point is the global mean, 1.5.
    live = nb.cells[1]
    history, got = _inspected(nb.cells[2])
    assert [r["loss"] for r in history] == [1.5, 1.5, 1.5]
    assert [r["epoch"] for r in history] == [1, 2, 3]
    assert got == [{"epoch": e, "loss": 1.5} for e in (1, 2, 3)]
    assert csv_path.read_text().splitlines() == ["epoch,epochs,loss", "1,3,1.5", "2,3,1.5", "3,3,1.5"]
    kinds = [(o.output_type, sorted(o.get("data", {}))) for o in live.outputs]
    assert not any(WIDGET_VIEW in data for _, data in kinds), kinds  # plain outputs: no widget manager needed
    # The dashboard's two outputs, updated in place to their final state: the status, then the titled figure.
    shown = [o for o in live.outputs if o.output_type == "display_data"]
    assert [sorted(o.data) for o in shown] == [["text/plain"], ["image/png", "text/plain"]], kinds
    assert shown[0].data["text/plain"].startswith("ddp_notebook · done · 2 ranks · epoch 3/3")
    assert shown[1].data["text/plain"].startswith("done · 2 ranks · epoch 3/3")
    assert "[rank 1] rank 1 finished epoch 3" in text(live)  # rank prints stay in the cell
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in nb.cells[2].outputs)  # show()

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 1.5), (2, 1.5), (3, 1.5)]

    quiet = nb.cells[3]
    assert [o.output_type for o in quiet.outputs] == ["stream"] * len(quiet.outputs)
    assert "nothing reported" in text(quiet)

    # 3 ranks, unequal n, rank 2 slow: each point waits for it, weighted by n.
    history, got3 = _inspected(nb.cells[5])
    assert [r["epoch"] for r in history] == [1, 2, 3]
    for record in history:
        assert record["loss"] == pytest.approx((0 * 10 + 1 * 20 + 2 * 30) / 60)
        assert record["samples"] == 60
        assert record["rank0_only"] == 5.0 and "partial" not in record  # rank 0's alone, not a partial mean
    assert [u for u in got3 if "loss" in u] == [{"epoch": e, "loss": history[0]["loss"], "samples": 60}
                                                for e in (1, 2, 3)]

    failed = nb.cells[6]
    kinds = [o.output_type for o in failed.outputs]
    assert kinds[-1] == "error" and "rank 1 gives up" in text(failed)
    pngs = [o for o in failed.outputs if o.output_type == "display_data" and "image/png" in o.data]
    assert len(pngs) == 1 and pngs[0].data["text/plain"].startswith("failed · 2 ranks · epoch ")  # updated in place
    assert kinds.index("display_data") < kinds.index("error")
    history, _ = _inspected(nb.cells[7])
    assert [(r["epoch"], r["loss"]) for r in history][:2] == [(1, 1.5), (2, 1.5)]
    assert all(r.get("partial") == "loss" for r in history[2:])  # epoch 3: rank 0's alone, marked


def _inspected(cell):
    lines = dict(line.split(" ", 1) for line in text(cell).splitlines() if line.startswith(("HISTORY", "GOT")))
    return json.loads(lines["HISTORY"]), json.loads(lines["GOT"])


@pytest.mark.timeout(60)
def test_launch_from_a_script_prints_one_line_per_epoch(tmp_path, no_leftovers):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import ddp_notebook
        from ddp_notebook import report

        def train():
            import torch.distributed as dist
            for epoch in range(1, 3):
                report(epoch=epoch, epochs=2, loss=dist.get_rank() + 1.0)

        if __name__ == "__main__":
            ddp_notebook.launch(train, cpus=2)
            print("history", ddp_notebook.last_job().history)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split("  (")[0] for line in lines[:2]] == ["epoch 1/2  loss 1.5", "epoch 2/2  loss 1.5"]
    assert lines[2] == "history [{'epoch': 1, 'epochs': 2, 'loss': 1.5}, {'epoch': 2, 'epochs': 2, 'loss': 1.5}]"
