"""Fault injection, repeated: a launcher is trusted only if it never hangs, never blames the wrong
rank and never leaves anything behind.  DDP_NOTEBOOK_FAULT_REPEATS raises the counts for a long run
(the README gives the long run's figures)."""
import contextlib
import os
import re
import signal
import stat
import threading
import time
from multiprocessing.connection import Client

import psutil
import pytest

import ddp_notebook
from ddp_notebook import RankError
from ddp_notebook.engine import spec as job_spec
from ddp_notebook.engine import job as engine_job
from ddp_notebook.wire import payload
from conftest import rank_processes
from nbrun import SharedKernel, gone, kernel, run_until_pids

REPEATS = int(os.environ.get("DDP_NOTEBOOK_FAULT_REPEATS", "1"))
pytestmark = [pytest.mark.timeout(300 * REPEATS), pytest.mark.slow]  # kernel tests are marked one by one


@pytest.fixture(scope="module")
def shared():
    """The kernel this module's tests take in turn (each ends its own jobs; nbrun.SharedKernel)."""
    module_kernel = SharedKernel("%load_ext ddp_notebook")
    yield module_kernel
    module_kernel.close()


def _blocked_bystanders(report_late_s: float = 0):
    import time

    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if report_late_s:  # the others lose this rank first; its own failure arrives that much later
            dist.destroy_process_group()
            time.sleep(report_late_s)
        raise ZeroDivisionError("rank 1 divided by zero")
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("late_report", [False, True])
def test_a_raising_rank_is_blamed_and_everyone_stops(no_leftovers, late_report):
    # late_report: the failing rank's report arrives after the bystanders' lost-peer errors
    runs = 10 * REPEATS if os.environ.get("DDP_NOTEBOOK_FAULT_REPEATS") else 2
    correct = 0
    for _ in range(runs):
        with pytest.raises(RankError) as info:
            ddp_notebook.launch(_blocked_bystanders, (1.0 if late_report else 0,), cpus=3)
        err = info.value
        stopped_after = time.time() - err.failure.time
        correct += err.rank == 1 and "ZeroDivisionError: rank 1 divided by zero" in str(err) \
            and "raise ZeroDivisionError" in err.failure.traceback and stopped_after < 5 + (1.0 if late_report else 0)
        assert rank_processes() == []
    print(f"blame{' (late report)' if late_report else ''}: {correct}/{runs}")
    assert correct == runs


def _dies(how):
    import ctypes
    import os
    import signal
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "abort":
            os.abort()
        else:
            ctypes.string_at(0)  # a real segmentation fault
    time.sleep(60)


@pytest.mark.parametrize("how,signame", [("sigkill", "SIGKILL"), ("abort", "SIGABRT"), ("segfault", "SIGSEGV")])
def test_a_rank_that_dies_is_named_with_its_signal(no_leftovers, how, signame):
    started = time.time()
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_dies, (how,), cpus=2)
    assert info.value.rank == 1
    assert f"rank 1 was killed by {signame}" in str(info.value)
    assert time.time() - started < 20


def _skips_a_collective():
    import torch
    import torch.distributed as dist

    if dist.get_rank() != 1:
        dist.all_reduce(torch.ones(1))
    return "done"


def test_a_skipped_collective_ends_at_the_timeout_naming_the_stuck_ranks(no_leftovers):
    timeout = 3
    spec = job_spec.resolve_devices(cpus=3)
    spec.timeout = timeout
    job = engine_job.Job(spec, payload.dumps(payload.CallTask(_skips_a_collective, (), {}, False, payload.Sources())))
    loaded_at = []  # rank 1 finished the task: every rank has loaded it, ranks 0 and 2 are in the collective
    job.add_listener(lambda job, kind, rank, body: loaded_at.append(time.time()) if kind == "result" else None)
    with pytest.raises(RankError) as info:
        job.start().result()
    took = time.time() - loaded_at[0]
    message = str(info.value)
    assert "a collective timed out on rank(s) 0, 2" in message
    assert "rank(s) 1 finished the cell without joining it" in message
    assert took < timeout + 5


def _hangs_forever():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))
    print("PID", os.getpid(), flush=True)
    import time

    time.sleep(3600)


def test_a_hang_without_timeout_can_be_interrupted(no_leftovers):
    main = threading.main_thread().ident
    timer = threading.Timer(6, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    started = time.time()
    with pytest.raises(KeyboardInterrupt):
        ddp_notebook.launch(_hangs_forever, cpus=2)
    assert time.time() - started < 6 + 5
    assert rank_processes() == []


TRAINING_CELL = '''%%ddp --cpus 2
import os, time
import torch, torch.distributed as dist
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 32))
for step in range(1000000):
    model(torch.randn(8, 32)).sum().backward()
    if step == 3:  # training, and its ranks have said they can stop at a boundary
        print("PID", os.getpid(), flush=True)
    time.sleep(0.005)'''


@pytest.mark.kernel
def test_interrupt_during_training_repeatedly(shared, no_leftovers):
    runs = 10 if os.environ.get("DDP_NOTEBOOK_FAULT_REPEATS") else 2
    ok = 0
    with shared.take() as (km, kc):
        kernel_process = psutil.Process(km.provisioner.process.pid)
        for _ in range(runs):
            msg_id, pids = run_until_pids(kc, TRAINING_CELL)
            km.interrupt_kernel()
            reply = kc.get_shell_msg(timeout=30)
            zombies = [c for c in kernel_process.children() if c.status() == psutil.STATUS_ZOMBIE]
            # A DDP loop's training forward is a stop boundary: the stop button ends the cell there, on every rank.
            ok += reply["content"].get("ename") == "CellStopped" and gone(pids, 5) and not zombies
        assert kc.execute_interactive("x = 1", timeout=30)["content"]["status"] == "ok"
    print(f"interrupt: {ok}/{runs}")
    assert ok == runs


@pytest.mark.kernel
def test_killing_the_kernel_during_training_repeatedly(no_leftovers):
    runs = 10 if os.environ.get("DDP_NOTEBOOK_FAULT_REPEATS") else 2
    ok = 0
    for _ in range(runs):
        with kernel() as (km, kc):
            _, pids = run_until_pids(kc, TRAINING_CELL)
            os.kill(km.provisioner.process.pid, signal.SIGKILL)
            ok += gone(pids, 10)
    print(f"kernel SIGKILL: {ok}/{runs}")
    assert ok == runs


@pytest.mark.kernel
def test_three_kernels_start_jobs_at_once_on_distinct_ports(no_leftovers):
    with contextlib.ExitStack() as stack:
        kernels = [stack.enter_context(kernel()) for _ in range(3)]
        cell = '%%ddp --cpus 2 --return port\nimport os\nport = int(os.environ["MASTER_PORT"])\nprint("port", port)'
        ids = [kc.execute(cell) for _, kc in kernels]
        ports = []
        for (_, kc), msg_id in zip(kernels, ids):
            reply = kc.get_shell_msg(timeout=120)
            assert reply["parent_header"]["msg_id"] == msg_id and reply["content"]["status"] == "ok"
            texts = []  # print() writes the number and the newline apart: they may come as two messages
            printed = kc.execute_interactive("print(port)", timeout=30, output_hook=lambda m: texts.append(
                m["content"].get("text", "")) if m["msg_type"] == "stream" else None)
            assert printed["content"]["status"] == "ok"
            ports.append("".join(texts).strip())
        assert len(set(ports)) == 3 and all(p.isdigit() for p in ports), ports


@pytest.mark.kernel
def test_an_output_flood_stays_under_jupyters_rate_limits(shared, no_leftovers):
    with shared.take() as (km, kc):
        msg_id = kc.execute("%%ddp --cpus 2\nfor i in range(200_000):\n    print('flood', i)")
        stamps = []  # (time, bytes) of every output message of the cell
        last_text = ""
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                stamps.append((time.time(), len(msg["content"]["text"].encode())))
                last_text = msg["content"]["text"]
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "ok"
    assert "flood 199999" in last_text
    worst_messages = worst_bytes = 0
    for t0, _ in stamps:  # every one-second window that starts at a message
        window = [b for t, b in stamps if t0 <= t < t0 + 1]
        worst_messages, worst_bytes = max(worst_messages, len(window)), max(worst_bytes, sum(window))
    print(f"flood: {len(stamps)} messages, worst second {worst_messages} messages / {worst_bytes} bytes")
    assert worst_messages < 1000 and worst_bytes < 1_000_000


def _quiet():
    import time

    time.sleep(3)
    return "untouched"


def test_the_channel_refuses_strangers_and_the_payload_is_private(no_leftovers):
    spec = job_spec.resolve_devices(cpus=2)
    job = engine_job.Job(spec, payload.dumps(payload.CallTask(_quiet, (), {}, False, payload.Sources()))).start()
    try:
        mode = stat.S_IMODE(os.stat(job.workdir).st_mode)
        assert mode == 0o700
        for name in os.listdir(job.workdir):
            assert stat.S_IMODE(os.stat(os.path.join(job.workdir, name)).st_mode) & 0o077 == 0
        with pytest.raises(Exception):  # wrong key: refused during the handshake
            Client(job.group.channel.address, family="AF_INET", authkey=b"not the key")
        import socket

        channel = job.group.channel
        with socket.create_connection(channel.address) as raw:  # no key at all: a forged message
            raw.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
            time.sleep(0.3)
        assert channel.refused >= 2
        assert job.result() == ["untouched", "untouched"]
    finally:
        job.stop()


BAD_INPUTS = [
    ("--gpus -1", "pass", "gpus must be at least 1"),
    ("--gpus 0,0", "pass", "lists a GPU twice"),
    ("--gpus 99", "pass", "99 GPUs asked for, but this machine has 0"),
    ("--gpus 3,", "pass", "GPU 3 not found; this machine has 0"),
    ("--gpus abc", "pass", "give a count (2) or indices"),
    ("--cpus 0", "pass", "cpus must be a positive number of ranks"),
    ("--cpus two", "pass", "invalid int value: 'two'"),
    ("--gpus 1 --cpus 2", "pass", "give either gpus or cpus, not both"),
    ("--nodes 2", "pass", "unrecognized arguments: --nodes 2"),
    ("--port 70000", "pass", "port must be between 1 and 65535"),
    ("--port 0", "pass", "port must be between 1 and 65535"),
    ("--timeout -3", "pass", "timeout must be a positive number of seconds"),
    ("--hang-after -5", "pass", "hang_after must be a positive number of seconds (0 or None: never), not -5.0"),
    ("--seed abc", "pass", "invalid int value: 'abc'"),
    ("--seed -1", "pass", "seed must be a non-negative integer"),
    ("--backend mpi", "pass", "invalid choice: 'mpi'"),
    ("--cpus 2 --backend nccl", "pass", "the nccl backend needs GPUs"),
    ("--output 3", "pass", "invalid choice: '3'"),
    ("--return 1x", "x = 1", "not a name: 1x"),
    ("--cpus 2", "   \n", "the %%ddp cell is empty"),
    ("--cpus 2", "for i in range(3)\n    pass", "SyntaxError in Cell In["),
    ("--cpus 2", "with lock:\n    pass", "cannot send 'lock' (lock) to the ranks"),
    ("--cpus 2", "next(numbers)", "cannot send 'numbers' (generator) to the ranks"),
    ("--cpus 2", "sock.getsockname()", "cannot send 'sock' (socket) to the ranks"),
    ("--cpus 2", "report(epoch=1)", "the cell reads report (line 2), which nothing defines"),
    ("--cpus 2 --return x,nothere", "x = 1\nprint(x)", "--return nothere: the cell never assigns it (no assignment, "
                                                        "import, def, class, for or with target, := or global of it "
                                                        "anywhere in it), so no rank could return it. No rank was "
                                                        "started."),
]


@pytest.mark.kernel
def test_bad_inputs_each_get_one_clear_message_and_start_nothing(no_leftovers):
    from nbrun import run_cells, text

    setup = "import socket, threading\nlock = threading.Lock()\nnumbers = (i for i in range(3))\nsock = socket.socket()"
    cells = ["%load_ext ddp_notebook", setup] + [f"%%ddp {flags}\n{body}" for flags, body, _ in BAD_INPUTS]
    cells.append("import ddp_notebook\nprint('jobs started:', ddp_notebook.last_job())")
    cells += ["%%ddp --cpus 2 --return a,only1\na = 5\nif rank == 1:\n    only1 = 1", "print(a)",
              # a NameError the magic's check cannot see coming
              "%%ddp --cpus 2\nundefined_name = 1\ndel undefined_name\nprint(undefined_name)"]
    nb, _ = run_cells(cells, timeout=180)
    answered = nb.cells[2:2 + len(BAD_INPUTS)]
    for cell, (flags, body, expected) in zip(answered, BAD_INPUTS):
        shown = text(cell)
        assert expected in shown, (flags, body, shown)
        assert "UsageError" in shown and "Traceback" not in shown and "[rank" not in shown, shown
    tail = nb.cells[2 + len(BAD_INPUTS):]
    assert text(tail[0]) == "jobs started: None\n"  # nothing was started for any refused cell
    assert "UsageError: --return: only1 was assigned on rank 1 but not on rank 0, whose values --return copies " \
           "(assign it on rank 0 too, or send it there: torch.distributed.broadcast_object_list); a copied back" \
           in text(tail[1])
    assert text(tail[2]) == "5\n"
    assert re.search(r"rank \d failed: NameError: name 'undefined_name' is not defined", text(tail[3]))
    assert "every rank failed the same way" in text(tail[3])
