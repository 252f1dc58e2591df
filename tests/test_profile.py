"""``--profile``: torch.profiler on every rank, one merged trace, and where each rank's time went."""
import dataclasses
import gzip
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddp_notebook
from ddp_notebook.engine.profiling import ProfileOptions, breakdown
from ddp_notebook.wire.errors import LaunchError
from nbrun import run_cells, text

pytestmark = pytest.mark.slow


def _rank_1_loader_sleeps(batches: int = 16):
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import Dataset

    from ddp_notebook import distributed_loader

    class Slow(Dataset):  # rank 1 reads its samples slowly: 5 ms each, 40 ms a batch
        def __init__(self):
            self.x, self.y = torch.randn(2 * 8 * batches, 16), torch.randn(2 * 8 * batches, 1)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            if dist.get_rank() == 1:
                time.sleep(0.005)
            return self.x[i], self.y[i]

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in distributed_loader(Slow(), batch_size=8):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return torch.autograd.profiler._is_profiler_enabled


def _collectives(trace: dict, pid: int) -> set[str]:
    return {e["name"] for e in trace["traceEvents"] if e.get("pid") == pid and e.get("ph") == "X"
            and e["name"] in ("gloo:all_reduce", "c10d::allreduce_")}


@pytest.mark.timeout(180)
def test_rank_1_waiting_for_data_is_the_straggler_and_the_merged_trace_holds_both_ranks(no_leftovers, tmp_path):
    enabled_after = ddp_notebook.launch(_rank_1_loader_sleeps, cpus=2, profile="steps=6,skip=3",
                                        log_dir=str(tmp_path))
    assert enabled_after == [False, False]  # (the profiler has stopped by the task's end)
    found = ddp_notebook.last_job().profile
    assert found.straggler == 1, found
    assert found.why.startswith("rank 1: ") and "waiting for data" in found.why, found.why
    summary = found.summary
    assert sorted(summary) == [0, 1] and all(sorted(s) == sorted(("compute", "communication", "data", "idle"))
                                            for s in summary.values())
    assert summary[1]["data"] > 6 * 0.03 and summary[0]["data"] < summary[1]["data"] / 4, summary
    assert summary[0]["communication"] > summary[1]["communication"] + 6 * 0.02, summary
    assert found.steps == {0: 6, 1: 6}
    with pytest.raises(dataclasses.FrozenInstanceError):
        found.straggler = 0

    assert os.path.dirname(found.trace) == str(tmp_path) and found.trace.endswith(".json.gz")
    with gzip.open(found.trace) as f:
        trace = json.load(f)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        assert _collectives(trace, rank) == {"gloo:all_reduce", "c10d::allreduce_"}, rank
    # Clocks aligned: each rank's profiled steps start within a step of the other's (same host, same clock).
    first = {rank: min(e["ts"] for e in trace["traceEvents"] if e.get("pid") == rank
                       and str(e.get("name", "")).startswith("ProfilerStep#")) for rank in (0, 1)}
    assert abs(first[0] - first[1]) < 100_000, first
    assert os.stat(found.trace).st_mode & 0o777 == 0o600


def _steps_by_report(steps: int = 20):
    import torch
    import torch.distributed as dist

    from ddp_notebook import report

    total = torch.zeros(1)
    for step in range(steps):
        total += 1
        dist.all_reduce(total)
        report(step=step, total=total.item())
    return dist.get_rank()


@pytest.mark.timeout(180)
def test_launch_profile_true_counts_report_calls_and_writes_beside_the_notebook(no_leftovers, tmp_path,
                                                                                 monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert ddp_notebook.launch(_steps_by_report, cpus=2, profile=True) == [0, 1]
    found = ddp_notebook.last_job().profile
    assert found.steps == {0: ProfileOptions().steps, 1: ProfileOptions().steps}  # report() calls are the steps
    assert os.path.dirname(found.trace) == str(tmp_path)
    with gzip.open(found.trace) as f:
        trace = json.load(f)
    assert all(_collectives(trace, rank) for rank in (0, 1))
    shown = capsys.readouterr().out
    assert "rank 0 (10 steps): compute " in shown and "rank 1 (10 steps): " in shown
    assert f"trace: {found.trace} (open it in https://ui.perfetto.dev" in shown


def _no_profiler_here():
    import sys

    import torch

    from ddp_notebook import distributed_loader
    from ddp_notebook.rank import profiling

    seen = []
    for (x,) in distributed_loader(torch.utils.data.TensorDataset(torch.randn(64, 2)), batch_size=4):
        seen.append(torch.autograd.profiler._is_profiler_enabled or profiling.active())
    return any(seen), "torch.profiler" in sys.modules


def _own_profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ddp_notebook import report

    for step in range(12):
        if step == 4:  # inside --profile's window (skip 1, warm-up 1, 6 recorded)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                torch.randn(100).sum()
        report(step=step)
    return any(e.name == "aten::sum" for e in prof.events())


@pytest.mark.timeout(180)
def test_a_job_without_profile_runs_no_profiler_and_a_cells_own_profiler_keeps_working(no_leftovers, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    results = ddp_notebook.launch(_no_profiler_here, cpus=2)
    assert [active for active, _ in results] == [False, False]
    assert ddp_notebook.last_job().profile is None and os.listdir(tmp_path) == []
    # The cell's own profiler, started inside --profile's window, records its ops; ours ends its window there.
    assert ddp_notebook.launch(_own_profiler, cpus=2, profile="steps=6,skip=1") == [True, True]
    cut_short = ddp_notebook.last_job().profile
    assert sorted(cut_short.summary) == [0, 1] and all(0 < n < 6 for n in cut_short.steps.values()), cut_short


def test_profile_options_are_checked_before_anything_starts():
    assert ProfileOptions.parse("steps=20,skip=5") == ProfileOptions(20, 5)
    assert ProfileOptions.parse("skip=0") == ProfileOptions(skip=0)
    assert ProfileOptions.parse(True) == ProfileOptions() and ProfileOptions.parse(None) is None
    for bad in ("steps=0", "steps=x", "every=3", "20", {"steps": -1}):
        with pytest.raises(LaunchError):
            ProfileOptions.parse(bad)
    with pytest.raises(LaunchError, match="several hosts"):
        ddp_notebook.launch(print, cpus=2, nnodes=2, profile=True)


def test_breakdown_splits_a_rank_window_into_compute_communication_data_and_idle():
    def x(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid}

    events = [x("ProfilerStep#1", 0, 1_000_000, "user_annotation"),
              x("ddp_notebook:data", 0, 200_000, "user_annotation"),
              x("aten::copy_", 50_000, 100_000),  # collation inside the data wait: data, not compute
              x("aten::addmm", 200_000, 300_000),
              x("gloo:all_reduce", 400_000, 300_000, "user_annotation", tid=2)]  # half behind the addmm
    seconds, overlap, steps = breakdown(events)
    assert seconds == pytest.approx({"data": 0.2, "compute": 0.2, "communication": 0.2, "idle": 0.4})
    assert overlap == pytest.approx(1 / 3) and steps == 1


@pytest.mark.timeout(240)
def test_a_profiled_cell_on_a_warm_pool_shows_its_breakdown_and_the_next_cell_runs_no_profiler(no_leftovers,
                                                                                                tmp_path):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "%ddp_start --cpus 2",
        "%%ddp --profile steps=5,skip=2\nimport torch, torch.distributed as dist\nfrom ddp_notebook import report\n"
        "t = torch.ones(1)\nfor step in range(12):\n    dist.all_reduce(t)\n    report(step=step)",
        "import ddp_notebook\nfound = ddp_notebook.last_job().profile\nprint('steps', found.steps)",
        "%%ddp --return active\nfrom ddp_notebook.rank import profiling\n"
        "active = torch.autograd.profiler._is_profiler_enabled or profiling.active()",
        "print('active', active)",
        "%ddp_stop",
    ], cwd=str(tmp_path))
    shown = text(nb.cells[2])
    assert "rank 0 (5 steps): compute " in shown and "ui.perfetto.dev" in shown, shown
    data = [output.get("data", {}) for output in nb.cells[2].outputs]
    assert any("image/png" in d for d in data)  # the stacked bar
    link = next(d["text/html"] for d in data if "text/html" in d)
    assert 'href="ddp_profile_job' in link and "ui.perfetto.dev" in link, link
    assert "steps {0: 5, 1: 5}" in text(nb.cells[3])
    assert "active False" in text(nb.cells[5])
    assert [name for name in os.listdir(tmp_path) if name.startswith("ddp_profile_job")]


_spans = st.lists(st.tuples(st.sampled_from(["aten::mm", "gloo:all_reduce", "ddp_notebook:data", "c10d::allreduce_"]),
                            st.integers(0, 1000), st.integers(1, 400), st.integers(1, 3)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_spans)
def test_the_four_categories_never_overlap_and_fill_the_window(spans):
    events = [{"ph": "X", "name": "ProfilerStep#1", "ts": 0, "dur": 1000, "cat": "user_annotation", "tid": 1}]
    events += [{"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid,
                "cat": "cpu_op" if name in ("aten::mm", "c10d::allreduce_") else "user_annotation"}
               for name, ts, dur, tid in spans]
    seconds, overlap, _ = breakdown(events)
    assert all(value >= 0 for value in seconds.values())
    assert sum(seconds.values()) == pytest.approx(0.001)  # the window: 1,000 µs
    assert overlap is None or 0 <= overlap <= 1
    if not any(name == "ddp_notebook:data" for name, *_ in spans):
        assert seconds["data"] == 0
