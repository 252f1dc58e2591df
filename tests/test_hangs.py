"""A hang explained: which ranks wait in which collective (torch's Flight Recorder), which rank has not joined it
and where it is, which rank finished already, which called another collective (real gloo ranks, 3 of them)."""
import re
import time

import pytest

import ddp_notebook
from ddp_notebook.engine import hangs
from nbrun import SharedKernel, execute, run_cell


@pytest.fixture(scope="module")
def shared():
    """The kernel this module's tests take in turn (each ends its own jobs; nbrun.SharedKernel)."""
    module_kernel = SharedKernel("%load_ext ddp_notebook\nimport torch, ddp_notebook")
    yield module_kernel
    module_kernel.close()


def _one_asleep():
    import time

    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 1:
        time.sleep(600)  # ASLEEP
    dist.all_reduce(t)


def _one_finished():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() != 1:
        dist.all_reduce(t)
    return dist.get_rank()


def _mismatched():
    import torch
    import torch.distributed as dist

    t = torch.ones(4)
    dist.all_reduce(t)
    if dist.get_rank() == 2:
        dist.all_gather([torch.ones(4) for _ in range(3)], t)
    else:
        dist.all_reduce(t)


def _loader_with_a_sleeper():
    import time

    import torch
    import torch.distributed as dist

    import ddp_notebook

    data = torch.utils.data.TensorDataset(torch.randn(600, 2))
    loader = ddp_notebook.distributed_loader(data, batch_size=2)
    for epoch in range(100):
        for batch, (x,) in enumerate(loader):
            if epoch == 0 and batch == 3 and dist.get_rank() == 1:
                time.sleep(8)  # SLEEPS
            time.sleep(0.01)


def _line_of(fn, marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if marker in line)


def _told_within(capsys, job, seconds: float, expected: str) -> str:
    """What the job said (on stderr) until it says ``expected`` (a pattern), or ``seconds`` passed."""
    told = ""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not re.search(expected, told) and not job.done:
        time.sleep(0.1)
        told += capsys.readouterr().err
    return told


def test_a_rank_asleep_before_an_all_reduce_is_named_with_its_line_and_the_job_goes_on(no_leftovers,
                                                                                      capsys):
    job = ddp_notebook.launch(_one_asleep, cpus=3, background=True, hang_after=2, timeout=120)
    try:
        # (started when every rank joined the group: hang_after + a few seconds from there, the start-up aside)
        told = _told_within(capsys, job, 60, r"rank 1 has not reached it")
        assert "made no progress for 2 s" in told, told
        assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+ since 0:00:0\d", told), told
        line = _line_of(_one_asleep, "# ASLEEP")
        assert "rank 1 has not reached it (its last was #" in told, told
        assert re.search(rf"rank 1 has not reached it .*: it is at _one_asleep \(test_hangs.py:{line}\), "
                         rf"`time.sleep\(600\)  # ASLEEP`", told), told
        assert job.status == "running"
        again = job.why()  # on demand: the same
        assert again.missing == [1] and sorted(again.waiting) == [0, 2], again
        assert again.waiting[0]["name"] == "all_reduce" and not again.mismatched
    finally:
        job.stop(timeout=30)
    assert job.done


def test_a_hang_in_a_loader_loop_is_said_and_the_job_then_stops_gracefully(no_leftovers, capsys):
    job = ddp_notebook.launch(_loader_with_a_sleeper, cpus=3, background=True, hang_after=2, timeout=120)
    try:
        told = _told_within(capsys, job, 60, r"rank 1 has not reached it")
        line = _line_of(_loader_with_a_sleeper, "# SLEEPS")
        assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+", told), told  # the loader's stop agreement
        assert re.search(rf"rank 1 has not reached it .*: it is at _loader_with_a_sleeper "
                         rf"\(test_hangs.py:{line}\), `time.sleep\(8\)  # SLEEPS`", told), told
        assert job.status == "running"
        job.stop(timeout=60)  # graceful: every rank stops at the batch boundary after rank 1 wakes
        assert job.status == "stopped"
        assert job.stopped_at is not None and job.stopped_at["epoch"] == 0, job.stopped_at
        assert len(job.wait(timeout=10)) == 3
    finally:
        if not job.done:
            job.stop(timeout=30, now=True)


def test_a_rank_that_finished_is_named_as_finished(no_leftovers, capsys):
    job = ddp_notebook.launch(_one_finished, cpus=3, background=True, hang_after=2, timeout=120)
    try:
        told = _told_within(capsys, job, 60, r"finished its task")
        assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+", told), told
        assert "rank 1 finished its task already" in told, told
        assert "rank 1 has not reached it" not in told, told
        assert job.why().finished == [1]
    finally:
        job.stop(timeout=30)


def test_mismatched_collectives_are_named_with_what_each_called(no_leftovers, capsys):
    job = ddp_notebook.launch(_mismatched, cpus=3, background=True, hang_after=2, timeout=120)
    try:
        told = _told_within(capsys, job, 60, r"disagree")
        assert re.search(r"rank 2 called all_gather #\d+ \(size 4\) where ranks 0 and 1 called all_reduce "
                         r"\(size 4\): the collectives disagree", told), told
    finally:
        job.stop(timeout=30)


def test_the_process_group_timeout_error_says_why(no_leftovers, capsys):
    job = ddp_notebook.launch(_one_asleep, cpus=3, background=True, hang_after=60, timeout=8)
    with pytest.raises(ddp_notebook.RankError) as failed:
        job.wait(timeout=90)
    text = str(failed.value)
    assert "why it was stuck" in text, text
    assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+", text), text
    assert "rank 1 has not reached it" in text, text


def test_hang_watch_counts_a_recent_collective_as_progress():
    watch = hangs.HangWatch(0.05)
    time.sleep(0.06)
    moving = hangs.Diagnosis("x", newest=time.time())
    assert watch.check(lambda: moving) is None  # a collective was just made
    stuck = hangs.Diagnosis("stuck", newest=time.time() - 1)
    time.sleep(0.06)
    assert watch.check(lambda: stuck) is stuck
    time.sleep(0.06)
    assert watch.check(lambda: stuck) is None  # said once per hang, while it says the same
    watch.progress()
    time.sleep(0.06)
    assert watch.check(lambda: stuck) is stuck


HUNG_CELL = '''%%ddp --cpus 3 --hang-after 2 --timeout 120
import time
import torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
if rank == 1:
    time.sleep(20)
dist.all_reduce(t)
print("DONE", rank)
'''


@pytest.mark.kernel
def test_a_hung_cell_says_why_by_itself_and_goes_on(shared, no_leftovers):
    with shared.take() as (km, kc):
        reply, told = run_cell(kc, HUNG_CELL, timeout=180)
        assert reply["status"] == "ok", told
        assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+ since", told), told
        assert "rank 1 has not reached it (its last was #" in told, told
        assert re.search(r"it is at cell line 7, `time.sleep\(20\)`", told), told
        assert told.count("DONE") == 3, told  # the job went on to its end


WARM_HUNG_CELL = '''%%ddp --background --hang-after 0
import time
import torch.distributed as dist
t = torch.ones(1)
dist.all_reduce(t)
if rank != 1:
    dist.all_reduce(t)
'''


@pytest.mark.kernel
def test_ddp_why_on_a_warm_pool_names_the_finished_rank(shared, no_leftovers):
    with shared.take() as (km, kc):
        execute(kc, ["%ddp_start --cpus 3"], timeout=120)
        execute(kc, [WARM_HUNG_CELL], timeout=60)
        told = ""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "finished its task" not in told:
            time.sleep(0.5)
            told = execute(kc, ["%ddp_why"])
        assert re.search(r"ranks 0 and 2 wait in all_reduce #\d+", told), told
        assert "rank 1 finished its task already" in told, told
        assert "made no progress" not in execute(kc, ["print('quiet')"])  # --hang-after 0: never said by itself
        execute(kc, ["ddp_notebook.last_job().stop(timeout=30)", "%ddp_stop"], timeout=120)
