"""launch() and spawn() with real gloo ranks, and refusals before any rank starts."""
import os
import socket
import re
import threading
import time

import pytest

import ddp_notebook
from ddp_notebook import LaunchError, RankError
from ddp_notebook.engine import spec as job_spec
from conftest import rank_processes

pytestmark = pytest.mark.timeout(120)


def _inspect(seed_check):
    import random
    import sys

    import numpy as np
    import torch
    import torch.distributed as dist

    ctx = ddp_notebook.rank_context()
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)

    class Squares(torch.utils.data.Dataset):  # defined here: travels by value, like a notebook class
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor(i * i)

    loader = torch.utils.data.DataLoader(Squares(), batch_size=4, num_workers=2)
    return {
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")},
        "sum": t.item(), "ctx": (ctx.rank, ctx.world_size, str(ctx.device)),
        "cwd": os.getcwd(), "path_head": sys.path[:3], "backend": dist.get_backend(),
        "random": (random.random(), float(np.random.rand()), float(torch.rand(1))),
        "loaded": sorted(int(x) for b in loader for x in b), "tensor": torch.ones(2, requires_grad=True) * seed_check,
    }


def test_launch_runs_on_every_rank_with_the_torchrun_contract(no_leftovers, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    out = ddp_notebook.launch(_inspect, (3,), cpus=2, seed=5)
    assert len(out) == 2
    for rank, values in enumerate(out):
        env = values["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["OMP_NUM_THREADS"] == str(max(1, os.cpu_count() // 2))
        assert values["sum"] == 3.0
        assert values["ctx"] == (rank, 2, "cpu")
        assert values["backend"] == "gloo"
        assert values["cwd"] == str(tmp_path)
        assert values["loaded"] == [i * i for i in range(8)]  # DataLoader workers with a by-value dataset
        assert values["tensor"].tolist() == [3.0, 3.0] and not values["tensor"].requires_grad
    assert out[0]["random"] == out[1]["random"]  # --seed: identical on every rank
    assert out[0]["env"]["MASTER_PORT"] == out[1]["env"]["MASTER_PORT"]


def _fails_on_rank_1(report_late_s: float = 0):
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if report_late_s:  # the others lose this rank first; its own failure arrives that much later
            dist.destroy_process_group()
            time.sleep(report_late_s)
        raise ValueError("rank one is broken")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


@pytest.mark.slow
def test_blame_names_the_failing_rank_even_when_its_report_arrives_last(no_leftovers):
    # The failing rank closes its process group first and reports 1.5 s later, so rank 0's
    # lost-peer error reaches the notebook first: first-come blame would name rank 0.
    started = time.time()
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_fails_on_rank_1, (1.5,), cpus=2)
    err = info.value
    assert err.rank == 1
    assert "ValueError: rank one is broken" in str(err)
    assert 'raise ValueError("rank one is broken")' in err.failure.traceback
    bystander = [f for f in err.failures if f.rank == 0]
    assert bystander and bystander[0].kind == "comm", err.failures
    assert time.time() - started < 20


@pytest.mark.parametrize("call, refused", [
    (lambda: ddp_notebook.launch(_asks_for_input, "data.csv", cpus=2),
     "launch(args=...) takes a tuple of fn's positional arguments, not str 'data.csv': for one argument write "
     "args=('data.csv',)"),
    (lambda: ddp_notebook.launch(_asks_for_input, 30, 1000, cpus=2),
     "launch(args=...) takes a tuple of fn's positional arguments, not int 30: for one argument write args=(30,)"),
    (lambda: ddp_notebook.launch(_asks_for_input, (), [("lr", 0.1)], cpus=2),
     "launch(kwargs=...) takes a dict of fn's keyword arguments by name, not list [('lr', 0.1)]"),
    (lambda: ddp_notebook.spawn(_asks_for_input, args=4),
     "spawn(args=...) takes a tuple of fn's positional arguments, not int 4: for one argument write args=(4,)"),
    (lambda: ddp_notebook.spawn(_asks_for_input, nprocs="2"),
     "spawn(nprocs=...) is the number of processes, a positive integer, not '2'"),
    # (a negative hang_after used to be taken: the job explained a hang at once, while nothing hung)
    (lambda: ddp_notebook.launch(_asks_for_input, cpus=2, hang_after=-5),
     "hang_after must be a positive number of seconds (0 or None: never), not -5"),
    (lambda: ddp_notebook.launch(_asks_for_input, cpus=2, log_dir=5), "log_dir must be a folder's path, not int 5"),
    (lambda: ddp_notebook.export(_asks_for_input, "never_written.py", "data.csv"),
     "export(args=...) takes a tuple of fn's positional arguments, not str 'data.csv': for one argument write "
     "args=('data.csv',)"),
    (lambda: ddp_notebook.follow("never_made", hang_after=-1),
     "hang_after must be a positive number of seconds (0 or None: never), not -1"),
])
def test_arguments_that_are_no_tuple_or_dict_are_refused_before_any_rank_starts(call, refused, no_leftovers):
    # ("data.csv") is a string: it would reach the function as eight one-character arguments
    with pytest.raises(LaunchError) as info:
        call()
    assert str(info.value) == refused
    assert not os.path.exists("never_written.py") and not os.path.exists("never_made")


def _reports_once():
    ddp_notebook.report(step=1, loss=0.5)
    return 1


def test_one_callback_given_alone_counts_as_a_list_of_it(no_leftovers):
    got = []
    assert ddp_notebook.launch(_reports_once, cpus=2, callbacks=got.append) == [1, 1]
    assert got == [{"step": 1, "loss": 0.5}]
    from ddp_notebook.engine.callbacks import Forwarder, as_list

    assert as_list(print) == [print] and as_list("wandb") == ["wandb"] and as_list((print, got.append)) == [
        print, got.append] and as_list(c for c in [print]) == [print]
    Forwarder(got.append).send([{"step": 2}])
    assert got[-1] == {"step": 2}
    with pytest.raises(TypeError) as info:
        Forwarder(5)
    assert str(info.value) == "a callback must be callable (one dict argument) or 'wandb', not 5"


def _asks_for_input():
    return input("learning rate? ")


@pytest.mark.timeout(60)
def test_input_in_a_rank_that_no_one_can_answer_fails_saying_why(no_leftovers):
    # launch() asks with this process's input(), which pytest's captured stdin refuses
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_asks_for_input, cpus=2)
    assert re.search(r"RuntimeError: rank (\d) asked for input \('\[rank \1\] learning rate\?'\), but the notebook "
                     r"could not ask \(OSError: pytest: reading from stdin while output is captured!",
                     str(info.value)), str(info.value)
    assert "closed file" not in str(info.value)


def test_prompts_waiting_behind_one_the_notebook_could_not_ask_are_refused_with_the_same_reason():
    # Both ranks asked before the notebook tried the first prompt: the second must get the first one's reason,
    # not a failure of the relay itself (CI once saw "TypeError: 'NoneType' object is not callable" here).
    from ddp_notebook.engine.prompts import PromptRelay
    from ddp_notebook.wire import protocol

    def prompter(text):
        raise OSError("no stdin here")

    sent = []
    relay = PromptRelay(7, prompter, send=lambda rank, message: sent.append((rank, message)), catch_up=lambda: None,
                        no_prompter=lambda: "unused", world_size=2)
    relay.take(1, {"id": "a", "prompt": "[rank 1] lr? "})
    relay.take(0, {"id": "b", "prompt": "[rank 0] lr? "})
    assert relay.ask_waiting(lambda: False) is None
    why = "the notebook could not ask (OSError: no stdin here)"
    assert sent == [(1, (protocol.ANSWER, {"task": 7, "id": "a", "refused": why})),
                    (0, (protocol.ANSWER, {"task": 7, "id": "b", "refused": why}))]
    relay.take(1, {"id": "c", "prompt": "[rank 1] again? "})
    assert sent[-1] == (1, (protocol.ANSWER, {"task": 7, "id": "c", "refused": why}))


@pytest.mark.slow
def test_a_failing_rank_stops_a_bystander_blocked_in_a_collective(no_leftovers):
    started = time.time()
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_fails_on_rank_1, cpus=2)
    assert info.value.rank == 1
    assert "traceback of rank 1" in str(info.value)
    assert rank_processes() == []
    assert time.time() - started < 15


def _killed_by_signal():
    import os
    import signal
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(30)


def test_a_rank_killed_by_a_signal_is_named_with_the_signal(no_leftovers):
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_killed_by_signal, cpus=2)
    assert info.value.rank == 1
    assert "SIGKILL" in str(info.value)


def _nccl_watchdog_ends_the_stuck_ranks():
    # What torch's default NCCL error handling does at the timeout: the watchdog thread logs (glog, on stderr) and
    # aborts the process, no Python exception.  Ranks 0 and 2 do the same; rank 1 never joined the collective.
    import sys
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == 1:
        return "finished"
    work = "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=3000)"
    caught = f"[Rank {rank}] Watchdog caught collective operation timeout: {work} ran for 3012 milliseconds " \
             f"before timing out."
    sys.stderr.write(
        f"[rank{rank}]:[E1130 23:50:01.426415540 ProcessGroupNCCL.cpp:632] {caught}\n"
        f"[rank{rank}]:[E1130 23:50:01.426530781 ProcessGroupNCCL.cpp:2271] [PG ID 0 PG GUID 0(default_pg) Rank "
        f"{rank}]  failure detected by watchdog at work sequence id: 7 PG status: last enqueued work: 7, last "
        f"completed work: 6\n"
        f"[rank{rank}]:[E1130 23:50:01.426601812 ProcessGroupNCCL.cpp:670] [Rank {rank}] Some NCCL operations have "
        f"failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run "
        f"on corrupted/incomplete data.\n"
        f"[rank{rank}]:[E1130 23:50:01.426613005 ProcessGroupNCCL.cpp:676] [Rank {rank}] To avoid data "
        f"inconsistency, we are taking the entire process down.\n"
        f"terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"  what():  [PG ID 0 PG GUID 0(default_pg) Rank {rank}] Process group watchdog thread terminated with "
        f"exception: {caught}\n"
        f"Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635\n")
    sys.stderr.flush()
    os.abort()


def _aborts_without_a_word():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.abort()
    time.sleep(30)


def test_a_rank_ended_by_the_nccl_watchdog_is_a_timeout_not_a_crash(no_leftovers):
    # Real processes killed by a real SIGABRT; what tells a timeout from a crash is the watchdog's line on stderr.
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_nccl_watchdog_ends_the_stuck_ranks, cpus=3)
    err = info.value
    assert err.failure.kind == "timeout" and err.rank in (0, 2)
    message = str(err)
    assert message.startswith("a collective timed out on rank(s) 0, 2: DistBackendError: collective timed out "
                              f"(NCCL watchdog): [Rank {err.rank}] Watchdog caught collective operation timeout: "
                              "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=3000) ran for "
                              "3012 milliseconds before timing out. (the watchdog then ended the rank with SIGABRT)")
    assert "rank(s) 1 finished the cell without joining it" in message
    assert "killed by SIGABRT" not in message
    # Without the watchdog's line, a SIGABRT is what it is.
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_aborts_without_a_word, cpus=2)
    assert info.value.failure.kind == "exit" and "rank 1 was killed by SIGABRT (abort or crash)" in str(info.value)


def _seed_style_train(rank, world_size, scale):
    # As in the PyTorch tutorial and the seed recipe: the user's code sets up the group.
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "localhost")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item() * scale


def _spawned_device(rank):
    from ddp_notebook.rank import checkpoint, context

    return rank, os.environ.get("CUDA_VISIBLE_DEVICES"), context.current().device, str(checkpoint.rank_device())


def test_spawn_on_gpus_leaves_the_device_to_the_user_s_code_not_cpu(no_leftovers, monkeypatch):
    import fake_nvml
    from ddp_notebook.engine import devices as gpus

    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.free2())  # two GPUs, as NVML would report them
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = ddp_notebook.spawn(_spawned_device, nprocs=2)
    visible = ",".join(fake_nvml.UUIDS[:2])  # every process sees every GPU, as under mp.spawn
    # Not "cpu": the device is the user's code's choice (checkpoint loads follow torch.cuda.current_device() once
    # CUDA is set up; with the CPU build here, the CPU).
    assert seen == [(0, visible, None, "cpu"), (1, visible, None, "cpu")]
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.FakeNVML(rows=[]))  # no GPU: CPU ranks, device cpu
    assert [(d[1], str(d[2])) for d in ddp_notebook.spawn(_spawned_device, nprocs=2)] == [(None, "cpu")] * 2


@pytest.mark.slow
def test_spawn_is_a_drop_in_for_mp_spawn(no_leftovers):
    assert ddp_notebook.spawn(_seed_style_train, args=(2, 10), nprocs=2) == [10.0, 10.0]
    context = ddp_notebook.spawn(_seed_style_train, args=(2, 1), nprocs=2, join=False, daemon=False,
                                 start_method="spawn")
    pids = context.pids()  # as mp.spawn's: every process's, once spawn() has returned
    assert len(set(pids)) == 2 and all(type(pid) is int and pid > 0 for pid in pids), pids
    while not context.join(timeout=0.5):
        pass
    assert context.result() == [1.0, 1.0]


@pytest.mark.slow
def test_three_jobs_at_once_get_distinct_ports(no_leftovers):
    results, errors = {}, []

    def run(i):
        try:
            results[i] = ddp_notebook.launch(lambda: int(os.environ["MASTER_PORT"]), cpus=2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ports = {results[i][0] for i in range(3)}
    assert len(ports) == 3


def test_refusals_come_before_any_rank_starts(monkeypatch):
    lock = threading.Lock()
    with pytest.raises(LaunchError, match=r"args\[0\].*lock"):
        ddp_notebook.launch(lambda x: x, (lock,), cpus=2)
    with pytest.raises(LaunchError, match="either gpus or cpus"):
        ddp_notebook.launch(print, gpus=1, cpus=2)
    with pytest.raises(LaunchError, match="nccl backend needs GPUs"):
        ddp_notebook.launch(print, cpus=2, backend="nccl")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {port} is already in use"):
            ddp_notebook.launch(print, cpus=2, port=port)
    from ddp_notebook.engine import devices as gpus

    two = [gpus.GPU(i, "NVIDIA H200", 0, 141 << 30, 0, str(i)) for i in range(2)]
    monkeypatch.setattr(gpus, "discover", lambda: two)
    with pytest.raises(LaunchError, match=r"3 GPUs asked for, but this machine has 2: 0: NVIDIA H200"):
        ddp_notebook.launch(print, gpus=3)
    with pytest.raises(LaunchError, match="GPU 5 not found"):
        ddp_notebook.launch(print, gpus="0,5")
    assert rank_processes() == []


def test_gpu_requests_map_to_visible_devices_and_nccl(monkeypatch, tmp_path):
    from ddp_notebook.engine import devices as gpus

    monkeypatch.setenv("DDP_NOTEBOOK_RESERVATIONS", str(tmp_path))

    inventory = [gpus.GPU(i, "GPU", used << 30, 80 << 30, util, str(i)) for i, (used, util) in
                 enumerate([(70, 90), (1, 0), (40, 50), (1, 10)])]
    monkeypatch.setattr(gpus, "discover", lambda: inventory)
    spec = job_spec.resolve_devices("0,2")
    assert spec.gpus == ["0", "2"] and spec.world_size == 2 and spec.backend == "nccl"
    assert job_spec.resolve_devices("3,").gpus == ["3"]
    least = job_spec.resolve_devices(2)
    assert least.gpus == ["1", "3"] and "least busy" in least.notes[0]
    spec.release_devices()  # (their jobs ended: every GPU is free again)
    least.release_devices()
    assert job_spec.resolve_devices(None).world_size == 4
    assert job_spec.resolve_devices(2, backend="gloo").backend == "gloo"
    from ddp_notebook.engine.backend import rank_environment

    env = rank_environment(least, 1234, 1, 1, 2)
    assert env["CUDA_VISIBLE_DEVICES"] == "1,3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["LOCAL_RANK"] == "1"


def _waits_for_a_stop():
    import ddp_notebook

    while not ddp_notebook.should_stop():
        time.sleep(0.01)
    return "stopped"


def test_a_jobs_phases_move_as_written_and_no_other_way(no_leftovers):
    """Job.phase goes NEW -> RUNNING -> (STOPPING ->) ENDING -> ENDED, as engine.job.MOVES says, and the job
    refuses any other move."""
    from ddp_notebook.engine.job import MOVES, Job, JobOptions, Phase
    from ddp_notebook.wire import payload

    def task(fn):
        return payload.dumps(payload.CallTask(fn, (), {}, False, payload.Sources()))

    seen = []
    job = Job(job_spec.resolve_devices(cpus=2), task(_waits_for_a_stop), JobOptions(stop_grace=30))
    job.add_listener(lambda job, kind, rank, body: seen.append(job.phase))
    assert job.phase is Phase.NEW and job.status == "running" and not job.done
    job.start().run_in_background()
    assert job.phase is Phase.RUNNING
    deadline = time.monotonic() + 60
    while job.stoppable != {0, 1} and time.monotonic() < deadline:
        time.sleep(0.05)
    job.stop(timeout=60)  # graceful: every rank said its task checks for it
    assert job.phase is Phase.ENDED and job.status == "stopped" and job.wait() == ["stopped", "stopped"]
    assert Phase.STOPPING in seen and seen[-1] is Phase.ENDED  # (the ENDED event comes once ended)
    order = [phase for i, phase in enumerate(seen) if i == 0 or phase is not seen[i - 1]]

    def reachable(start):  # (listeners see the phases events come in: a phase may pass with no event)
        found, todo = set(), [start]
        while todo:
            for later in MOVES[todo.pop()] - found:
                found.add(later)
                todo.append(later)
        return found

    assert order[0] is Phase.RUNNING and all(later in reachable(earlier) for earlier, later in zip(order, order[1:])), \
        order
    with pytest.raises(RuntimeError, match=r"cannot go from ended to running"):
        job._move(Phase.RUNNING)
    assert job.phase is Phase.ENDED
