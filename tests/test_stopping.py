"""Graceful stop: the first interrupt (or Stop, or job.stop()) ends the cell at the same batch on every rank and
hands the model back; a second interrupt, or no boundary within the grace period, stops hard."""
import re
import time
import traceback

import pytest

import ddp_notebook
from ddp_notebook import JobStopped
from ddp_notebook.engine.job import observe_jobs
from ddp_notebook.wire import protocol
from conftest import rank_processes
from nbrun import SharedKernel, gone, run_until_pids, until_idle

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


@pytest.fixture(scope="module")
def shared():
    """The module's kernel tests take one kernel in turn (each ends its own jobs)."""
    module_kernel = SharedKernel("%load_ext ddp_notebook\nimport torch, ddp_notebook")
    yield module_kernel
    module_kernel.close()

LOADER_CELL = '''%%ddp --cpus 2 --return model
import os, time
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
data = torch.utils.data.TensorDataset(torch.randn(400, 4), torch.randn(400, 1))
loader = ddp_notebook.distributed_loader(data, batch_size=2)
model = DDP(torch.nn.Linear(4, 1))
print("PID", os.getpid(), flush=True)
for epoch in range(1000):
    seen = 0
    for x, y in loader:
        model(x).sum().backward()
        seen += 1
        time.sleep(0.02)
    print(f"EPOCH-END rank {rank} epoch {epoch} batches {seen}", flush=True)
'''

STEP_CELL = '''%%ddp --cpus 2 --return steps
import os, time
import torch.distributed as dist
print("PID", os.getpid(), flush=True)
steps = 0
while not ddp_notebook.should_stop():
    dist.all_reduce(torch.ones(1))
    steps += 1
    time.sleep(0.01)
print(f"LOOP-END rank {rank} steps {steps}", flush=True)
'''

STUCK_CELL = '''%%ddp --cpus 2
import os, time
data = torch.utils.data.TensorDataset(torch.randn(400, 4))
loader = ddp_notebook.distributed_loader(data, batch_size=2)
print("PID", os.getpid(), flush=True)
for epoch in range(1000):
    for (x,) in loader:
        if epoch == 0 and rank == 1:
            time.sleep(600)  # never reaches the next batch boundary
'''


def _interrupt_and_collect(km, kc, msg_id, interrupts=1, between=1.0):
    """Interrupt the running cell ``interrupts`` times; its reply and what it printed."""
    for i in range(interrupts):
        if i:
            time.sleep(between)
        km.interrupt_kernel()
    reply, told = until_idle(kc, msg_id)
    return {"content": reply}, told


def _output(kc, code):
    told = []
    kc.execute_interactive(code, timeout=60, output_hook=lambda m: told.append(m["content"].get("text", ""))
                           if m["msg_type"] == "stream" else None)
    return "".join(told)


@pytest.mark.kernel
def test_the_stop_button_ends_a_loader_loop_at_the_same_batch_on_every_rank_and_hands_the_model_back(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, LOADER_CELL)
        time.sleep(3)  # inside epoch 0 or later
        reply, told = _interrupt_and_collect(km, kc, msg_id)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "CellStopped", told
        assert "Traceback" not in told and "KeyboardInterrupt" not in told, told
        stopped = re.search(r"ddp_notebook: stopped at epoch (\d+), batch (\d+)", told)
        assert stopped, told
        epoch, batch = map(int, stopped.groups())
        ends = re.findall(r"EPOCH-END rank (\d) epoch (\d+) batches (\d+)", told)
        last = {rank: (int(e), int(b)) for rank, e, b in ends}  # each rank's last epoch: the one cut short
        assert last == {"0": (epoch, batch), "1": (epoch, batch)}, told
        assert 0 < batch < 100
        assert _output(kc, "print(type(model).__name__, model.weight.shape)").strip() == \
            "Linear torch.Size([1, 4])"
        assert gone(pids, 10)


@pytest.mark.kernel
def test_the_stop_button_ends_a_should_stop_loop_at_the_same_step(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, STEP_CELL)
        time.sleep(2)
        reply, told = _interrupt_and_collect(km, kc, msg_id)
        assert reply["content"]["ename"] == "CellStopped", told
        stopped = re.search(r"ddp_notebook: stopped at step (\d+)", told)
        assert stopped, told
        step = int(stopped.group(1))
        assert sorted(re.findall(r"LOOP-END rank (\d) steps (\d+)", told)) == [("0", str(step)), ("1", str(step))]
        assert _output(kc, "print(steps)").strip() == str(step)
        assert gone(pids, 10)


LAUNCH_CELL = '''import os, time
import torch.distributed as dist

def train():
    print("PID", os.getpid(), flush=True)
    steps = 0
    while not ddp_notebook.should_stop():
        dist.all_reduce(torch.ones(1))
        steps += 1
        time.sleep(0.01)
    return steps

values = ddp_notebook.launch(train, cpus=2)
'''


@pytest.mark.kernel
def test_a_foreground_launch_stopped_gracefully_fails_its_cell_with_the_values_and_run_all_stops(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, LAUNCH_CELL, stop_on_error=True)
        queued = kc.execute("saved = 'the save cell ran'")  # as "Run All" queues the next cell
        time.sleep(2)
        km.interrupt_kernel()
        replies = {}
        while len(replies) < 2:
            msg = kc.get_shell_msg(timeout=60)
            replies[msg["parent_header"]["msg_id"]] = msg["content"]
        assert [replies[msg_id]["status"], replies[queued]["status"]] == ["error", "aborted"]
        assert replies[msg_id]["ename"] == "Stopped"
        rendered = "\n".join(replies[msg_id]["traceback"])
        stopped = re.fullmatch(r"ddp_notebook: job #\d+ stopped at step (\d+); its per-rank values are this "
                               r"exception's \.results \(and ddp_notebook\.last_job\(\)\.wait\(\)\)\. The cells queued "
                               r"after this one are not run\.", rendered)
        assert stopped, rendered
        step = int(stopped.group(1))
        assert _output(kc, "print('values' in dir(), 'saved' in dir(), ddp_notebook.last_job().wait())").strip() == \
            f"False False [{step}, {step}]"
        assert gone(pids, 10)


def _checks_for_a_stop_and_returns_7():
    return ddp_notebook.should_stop() or 7


def test_a_foreground_launch_that_ends_without_a_stop_returns_its_values(no_leftovers):
    assert ddp_notebook.launch(_checks_for_a_stop_and_returns_7, cpus=2) == [7, 7]


@pytest.mark.kernel
def test_a_second_interrupt_stops_hard(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, STUCK_CELL)
        time.sleep(2)
        reply, told = _interrupt_and_collect(km, kc, msg_id, interrupts=2)
        assert reply["content"]["ename"] == "KeyboardInterrupt", told
        assert gone(pids, 5), "ranks outlived the second interrupt by more than 5 s"


@pytest.mark.kernel
def test_no_boundary_within_the_grace_period_stops_hard(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, STUCK_CELL.replace("--cpus 2", "--cpus 2 --grace 2"))
        time.sleep(2)
        started = time.monotonic()
        reply, told = _interrupt_and_collect(km, kc, msg_id)
        assert reply["content"]["ename"] == "KeyboardInterrupt", told
        assert "no batch boundary within 2 s of the stop; stopping hard. Where each rank was:" in told
        assert re.search(r"rank 0: all_reduce ← Cell In\[\d+\] line 7\nrank 1: Cell In\[\d+\] line 9", told), told
        assert gone(pids, 5)
        assert time.monotonic() - started >= 2


def _train_until_stopped():
    import time

    import torch

    import ddp_notebook

    data = torch.utils.data.TensorDataset(torch.randn(400, 4))
    loader = ddp_notebook.distributed_loader(data, batch_size=2)
    print("PID", flush=True)
    batches = 0
    for epoch in range(1000):
        for _ in loader:
            batches += 1
            time.sleep(0.01)
    return batches


def _wait_until_stoppable(job):
    deadline = time.monotonic() + 60
    while job.stoppable != {0, 1} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.stoppable == {0, 1}


def _interrupt_as_the_job_starts():
    """The stop button pressed while the job's start is drawn (a listener of its STARTED event raises), once."""
    armed = [True]

    def interrupt_on_start(source, kind, rank, body):
        if kind == protocol.STARTED and armed:
            armed.clear()
            raise KeyboardInterrupt

    def observe(job):
        if armed:
            job.listeners.append(interrupt_on_start)

    observe_jobs(observe)
    return armed


def _sleeps_a_minute():
    time.sleep(60)


def test_the_stop_button_as_a_job_starts_stops_its_loop_gracefully_at_the_first_boundary(no_leftovers):
    """The interrupt lands in a listener of the job's start (the dashboard drawing itself), before any rank has said
    its task can stop: the ranks already have the task, so the wait asks them to stop at their first boundary."""
    armed = _interrupt_as_the_job_starts()
    with pytest.raises(ddp_notebook.Stopped) as raised:
        ddp_notebook.launch(_train_until_stopped, cpus=2)
    assert not armed, "the listener never ran"
    assert "interrupt_on_start" not in "".join(traceback.format_tb(raised.tb))  # raised by the wait, not the start
    job = ddp_notebook.last_job()
    assert job.status == "stopped" and job.stopped_at == {"epoch": 0, "batch": job.stopped_at["batch"]}
    assert raised.value.results == [None, None]  # the function ended in its loader, on both ranks
    assert rank_processes() == []
    assert ddp_notebook.launch(_checks_for_a_stop_and_returns_7, cpus=2) == [7, 7]  # the next job runs


def test_the_stop_button_as_a_job_starts_stops_a_task_with_no_boundary_hard_within_the_announce_wait(no_leftovers,
                                                                                                     capfd):
    armed = _interrupt_as_the_job_starts()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt) as raised:
        ddp_notebook.launch(_sleeps_a_minute, cpus=2)
    assert not armed and not isinstance(raised.value, ddp_notebook.Stopped)
    assert time.monotonic() - began < 30  # (not the minute: stopped after the 2 s the ranks had to say they could)
    assert "no batch boundary within 2 s of the stop; stopping hard" in capfd.readouterr().err
    assert ddp_notebook.last_job().status == "stopped"
    assert rank_processes() == []


def test_job_stop_ends_a_background_job_gracefully_and_now_true_hard(no_leftovers):
    job = ddp_notebook.launch(_train_until_stopped, cpus=2, background=True)
    _wait_until_stoppable(job)
    job.stop()
    assert job.status == "stopped"
    assert job.wait() == [None, None]  # ended at the next loader iteration: the function returned nothing
    assert set(job.stopped_at) == {"epoch", "batch"} and job.stopped_text.startswith("stopped at epoch ")
    assert rank_processes() == []

    job = ddp_notebook.launch(_train_until_stopped, cpus=2, background=True)
    _wait_until_stoppable(job)
    job.stop(now=True)
    assert job.status == "stopped"
    with pytest.raises(JobStopped):
        job.wait()
    assert job.stopped_at is None


def _counts_agreements(batches_per_rank):
    """Iterate a loader of tiny batches to its end, then a loop of should_stop() calls; how many batches and calls
    each made, and how many of the stop check's all-reduces they cost."""
    import torch
    import torch.distributed as dist

    import ddp_notebook

    all_reduce, agreements = dist.all_reduce, []

    def counted(*args, **kwargs):
        agreements.append(kwargs.get("group"))
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted  # (the stop check looks it up at each call)
    try:
        loader = ddp_notebook.distributed_loader(torch.utils.data.TensorDataset(torch.arange(2 * batches_per_rank)),
                                                 batch_size=1)
        batches = sum(1 for _ in loader)
        by_loader = len(agreements)
        calls = 0
        while calls < batches_per_rank and not ddp_notebook.should_stop():
            calls += 1
    finally:
        dist.all_reduce = all_reduce
    return batches, by_loader, calls, len(agreements) - by_loader


def test_a_loop_of_small_steps_pays_for_a_stop_check_about_every_50_ms_not_every_step(no_leftovers):
    """Every boundary would cost a loop of 1.7 ms steps about as much again (a gloo all-reduce); the ranks agree at
    one boundary in about 50 ms of steps instead, the same one on every rank (the test above: they stop together)."""
    out = ddp_notebook.launch(_counts_agreements, (3000,), cpus=2)
    for batches, by_loader, calls, by_calls in out:
        assert batches == 3000 and calls == 3000
        # A batch of one index takes well under 5 ms even on a busy machine: at most one agreement in ten.
        assert 1 <= by_loader <= batches // 10 and 1 <= by_calls <= calls // 10, out
    assert out[0] == out[1]  # the same boundaries agreed on, on both ranks


@pytest.mark.kernel
def test_a_graceful_stop_on_the_warm_pool_keeps_the_pool_and_its_state(shared, no_leftovers):
    with shared.take() as (km, kc):
        _output(kc, "%ddp_start --cpus 2")
        cell = LOADER_CELL.replace("%%ddp --cpus 2 --return model", "%%ddp --return model")
        msg_id, pids = run_until_pids(kc, cell)
        time.sleep(3)
        reply, told = _interrupt_and_collect(km, kc, msg_id)
        assert reply["content"]["ename"] == "CellStopped", told
        assert re.search(r"ddp_notebook: stopped at epoch \d+, batch \d+; --return copied model to the notebook\. "
                         r"The cells queued after this one are not run\.", told), told
        assert "restarted" not in told
        after = _output(kc, "%%ddp\nprint('AFTER', os.getpid(), type(model).__name__)")
        assert set(map(int, re.findall(r"AFTER (\d+) DistributedDataParallel", after))) == pids, after
        _output(kc, "%ddp_stop")
        assert gone(pids, 10)


STACKS_CELL = '''%%ddp --cpus 2 --background
import os, time
import torch.distributed as dist
print("PID", os.getpid(), flush=True)
if rank == 0:
    time.sleep(600)
dist.all_reduce(torch.ones(1))
'''


@pytest.mark.kernel
def test_stacks_show_where_each_rank_is_while_one_waits_in_all_reduce(shared, no_leftovers):
    with shared.take() as (km, kc):
        kc.execute_interactive(STACKS_CELL, timeout=60)
        number = int(re.search(r"\d+", _output(kc, "print(len(In) - 2)")).group())
        deadline = time.monotonic() + 90
        told = ""
        while time.monotonic() < deadline and told.count("Cell In[") < 2:  # until both ranks are in the cell
            time.sleep(0.5)
            told = _output(kc, "%ddp_stacks")
        assert re.search(rf"rank 0: Cell In\[{number}\] line 6\n", told), told  # time.sleep: C code, Python's line
        assert re.search(rf"rank 1: all_reduce ← Cell In\[{number}\] line 7", told), told
        same = _output(kc, f"print(Out[{number}].stacks())")
        assert f"rank 1: all_reduce ← Cell In[{number}] line 7" in same
        _output(kc, f"Out[{number}].stop(now=True)")


@pytest.mark.kernel
def test_sigusr2_to_the_kernel_shows_the_stacks_of_a_hung_foreground_cell_without_stopping_it(shared, no_leftovers):
    import os
    import signal

    with shared.take() as (km, kc):
        msg_id, pids = run_until_pids(kc, STACKS_CELL.replace(" --background", ""))
        time.sleep(2)  # rank 0 printed its PID from the cell: it sleeps there; rank 1 is in all_reduce or about to be
        os.kill(km.provisioner.process.pid, signal.SIGUSR2)
        told = ""
        deadline = time.monotonic() + 30
        while "rank 1:" not in told and time.monotonic() < deadline:
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                told += msg["content"]["text"]
        assert re.search(r"where each rank is \(job #\d+\):\nrank 0: Cell In\[\d+\] line 6\n"
                         r"rank 1: all_reduce ← Cell In\[\d+\] line 7", told), told
        assert all(psutil_alive(p) for p in pids)  # the job goes on
        _interrupt_and_collect(km, kc, msg_id)
        assert gone(pids, 5)


def psutil_alive(pid):
    import psutil

    return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def _skips_the_collective():
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_a_timeout_shows_where_the_ranks_that_did_not_time_out_were(no_leftovers):
    with pytest.raises(ddp_notebook.RankError) as info:
        ddp_notebook.launch(_skips_the_collective, cpus=2, timeout=3)
    assert re.search(r"where the other ranks were:\nrank 0: _skips_the_collective \(test_stopping.py:\d+\)",
                     str(info.value)), str(info.value)


def test_a_ranks_inbox_counts_a_stop_at_a_boundary_and_keeps_the_other_messages_in_order(monkeypatch):
    # The rank's main thread reads its messages itself: between tasks it waits for the next one; during a task a
    # boundary reads what has arrived, where only a stop request counts at once.
    from multiprocessing import Pipe

    from ddp_notebook.rank import stopping, worker
    from ddp_notebook.wire import protocol

    asked = []
    monkeypatch.setattr(stopping, "request", asked.append)
    notebook, rank = Pipe()
    inbox = worker.Inbox(rank)
    notebook.send((protocol.RUN, {"task": 1}))
    assert inbox.next() == (protocol.RUN, {"task": 1})
    inbox.take_waiting()  # nothing has arrived: it does not wait
    assert asked == []
    notebook.send((protocol.SYNC, {"task": 1}))
    notebook.send((protocol.STOP, {"task": 1}))
    notebook.send((protocol.EXIT, {}))
    deadline = time.monotonic() + 10
    while not rank.poll() and time.monotonic() < deadline:
        time.sleep(0.01)
    inbox.take_waiting()
    assert asked == [1]
    assert inbox.next() == (protocol.SYNC, {"task": 1})
    assert inbox.next() == (protocol.EXIT, {})
    notebook.send((protocol.RUN, {"task": 2}))
    assert inbox.next() == (protocol.RUN, {"task": 2})


def test_an_interrupt_while_the_inbox_reads_at_a_boundary_loses_no_message(monkeypatch):
    # The interrupt (a cell's hard stop) is raised once what was read is kept and the inbox is free again.
    import os
    import signal
    from multiprocessing import Pipe

    from ddp_notebook.rank import stopping, worker
    from ddp_notebook.wire import protocol

    asked = []
    monkeypatch.setattr(stopping, "request", asked.append)
    notebook, rank = Pipe()

    class InterruptedWhileReading:  # the rank's connection; SIGINT arrives in the middle of each read
        def __getattr__(self, name):
            return getattr(rank, name)

        def recv(self):
            os.kill(os.getpid(), signal.SIGINT)
            return rank.recv()

    def interrupt(signum, frame):  # the rank's handler while a task runs
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        inbox = worker.Inbox(InterruptedWhileReading())
        notebook.send((protocol.STOP, {"task": 4}))
        notebook.send((protocol.SYNC, {"task": 4}))
        deadline = time.monotonic() + 10
        while not rank.poll() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(KeyboardInterrupt):
            inbox.take_waiting()
        assert asked == [4]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert inbox.next() == (protocol.SYNC, {"task": 4})
    finally:
        signal.signal(signal.SIGINT, previous)
