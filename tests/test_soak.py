"""A kernel that runs many jobs does not grow: threads, fds, listening sockets and memory stay put.

Every kind of job, many times: cold cells, warm-pool cells, background jobs, ``launch()``,
``follow()``, a failing cell and interrupts.  After one round of warm-up (imports, caches), the
kernel's threads, fds and listening sockets (read from the socket table: a listener left behind
under a thread blocked in ``accept()`` has no fd) must be back exactly where they were after every
round, and its own memory (PSS of its anonymous and shared-memory pages) must grow by less than ``PSS_BOUND``.
DDP_NOTEBOOK_SOAK_ROUNDS raises the number of rounds for a long run.
"""
import os
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest

from nbrun import kernel
from sockets import listeners, new_listeners

ROUNDS = int(os.environ.get("DDP_NOTEBOOK_SOAK_ROUNDS", "1"))
# Each round ships 16 MiB (data) to four cold jobs: one that kept its payload or its shared memory would
# add 64 MiB a round.  What may grow is small: 1.3 to 4.2 MiB a round here (about 90 KiB per dashboard,
# whose widget models ipywidgets keeps while their outputs exist; the background jobs %ddp_jobs lists;
# IPython's history, output cache and traceback source cache; allocator fragmentation).
PSS_BOUND = (32 + 4 * ROUNDS) * 2**20
pytestmark = [pytest.mark.timeout(120 + 60 * ROUNDS), pytest.mark.slow, pytest.mark.kernel]

SETUP = """
%load_ext ddp_notebook
import ddp_notebook, torch
from ddp_notebook import report
data = torch.arange(4 * 2**20, dtype=torch.float32)   # 16 MiB: shipped through shared memory

def total(scale):
    return float(data.double().sum()) * scale
"""
EXPORTED = """
def reports():
    from ddp_notebook import report
    for epoch in (1, 2, 3):
        report(epoch=epoch, epochs=3, loss=1.0 / epoch)
ddp_notebook.export(reports, {script!r})
"""
COLD = "%%ddp --cpus 2\nreport(epoch=1, epochs=1, loss=float(data[rank]))\nprint(rank, float(data.double().sum()))"
SLEEPS = "%%ddp{flags}\nimport os, time\nprint('PID', os.getpid(), flush=True)\ntime.sleep(120)"


def _run(kc, code, ok=True):
    # stop_on_error=False: the kernel would abort (not run) a request that arrives while it handles an error.
    reply = kc.execute_interactive(code, timeout=120, output_hook=lambda msg: None, stop_on_error=False)
    assert (reply["content"]["status"] == "ok") == ok, (code, reply["content"])
    return reply


def _interrupt(km, kc, flags):
    """Interrupt a cell once both its ranks are running it."""
    msg_id, pids = kc.execute(SLEEPS.format(flags=flags), stop_on_error=False), set()
    while len(pids) < 2:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            pids.update(re.findall(r"PID (\d+)", msg["content"]["text"]))
    km.interrupt_kernel()
    deadline, said = time.monotonic() + 60, []
    while True:  # what the cell says meanwhile is kept: a cell that never ends shows where it stood
        assert time.monotonic() < deadline, f"no reply 60 s after the interrupt; the cell said: {''.join(said)}" \
                                            f"\n{_stacks(km.provisioner.process.pid)}"
        while kc.iopub_channel.msg_ready():
            msg = kc.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                said.append(msg["content"]["text"])
        if kc.shell_channel.msg_ready():
            reply = kc.get_shell_msg(timeout=1)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        time.sleep(0.05)
    assert reply["content"]["ename"] == "KeyboardInterrupt", (reply["content"], said)


def _stacks(kernel_pid: int) -> str:
    """Where the kernel and its processes stand, for a failure message (py-spy reads them from outside)."""
    spy = shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not installed: no stacks)"
    dumps = []
    for proc in [psutil.Process(kernel_pid), *psutil.Process(kernel_pid).children(recursive=True)]:
        try:
            out = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True, timeout=20)
            dumps.append(out.stdout + out.stderr)
        except (subprocess.TimeoutExpired, psutil.Error) as exc:
            dumps.append(f"{proc.pid}: {exc}")
    return "\n".join(dumps)


def _round(km, kc, run_dir):
    # Cold jobs (each starts and ends its own ranks) cost seconds here: four of them.
    _run(kc, COLD)
    _interrupt(km, kc, " --cpus 2")
    _run(kc, "%%ddp --cpus 2 --background\nreport(epoch=1, epochs=1, loss=1.0)")
    _run(kc, "assert len(_.wait(timeout=60)) == 2")
    _run(kc, "assert ddp_notebook.launch(total, args=(2,), cpus=2, background=True).wait(timeout=60) == "
             "[2 * float(data.double().sum())] * 2")
    _run(kc, f"assert ddp_notebook.follow({run_dir!r}, timeout=30).status == 'done'")
    _run(kc, "%ddp_start --cpus 2")
    _run(kc, "%%ddp\nkept = float(data.double().sum()) + rank\nreport(epoch=1, epochs=1, loss=kept)")
    _run(kc, "%%ddp\nraise ValueError('on purpose')", ok=False)  # every rank alike: the pool stays
    _run(kc, "%%ddp\nprint(rank, kept)")
    _interrupt(km, kc, "")
    _run(kc, "assert ddp_notebook.launch(total, args=(1,)) == [float(data.double().sum())] * 2")  # on the pool
    _run(kc, "%ddp_stop")


def _own_pss(pid):
    """PSS of the process's own memory (anonymous and shared-memory pages): the share of file-backed pages
    (torch's libraries) moves with whatever else on the machine maps the same files, by 100 MiB here."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return sum(int(fields[key].split()[0]) * 1024 for key in ("Pss_Anon", "Pss_Shmem"))


def _measure(kc, kernel_process, listening_before):
    _run(kc, "import gc; gc.collect()")  # garbage in cycles is not a leak: collected now, not at random
    return {"threads": kernel_process.num_threads(), "fds": kernel_process.num_fds(),
            "listeners": sorted(new_listeners(listening_before, kernel_process.pid)),
            "pss": _own_pss(kernel_process.pid), "pss_all": kernel_process.memory_full_info().pss}


def _settled(kc, kernel_process, listening_before, baseline, within=10.0):
    """The figures once threads and fds are back at (or under) the baseline and no listener is left, or as they are
    at the deadline.  (Under: the baseline may catch a file IPython's history holds open for a moment.)"""
    deadline = time.monotonic() + within
    while True:
        now = _measure(kc, kernel_process, listening_before)
        if now["threads"] <= baseline["threads"] and now["fds"] <= baseline["fds"] and not now["listeners"] \
                or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def _steady(kc, kernel_process, listening_before, within=10.0):
    """The figures once two readings half a second apart agree (IPython's history writes open fds for a moment)."""
    deadline = time.monotonic() + within
    previous = _measure(kc, kernel_process, listening_before)
    while True:
        time.sleep(0.5)
        now = _measure(kc, kernel_process, listening_before)
        if all(now[k] == previous[k] for k in ("threads", "fds", "listeners")) or time.monotonic() > deadline:
            return now
        previous = now


def test_a_kernel_running_many_jobs_does_not_grow(tmp_path):
    script = str(tmp_path / "job.py")
    with kernel("") as (km, kc):
        _run(kc, SETUP)
        _run(kc, EXPORTED.format(script=script))
        subprocess.run([sys.executable, script], cwd=str(tmp_path), check=True, capture_output=True, timeout=60)
        kernel_process = psutil.Process(km.provisioner.process.pid)
        _round(km, kc, str(tmp_path))  # warm-up: imports, caches, the first dashboard
        listening = listeners()
        start = _steady(kc, kernel_process, listening)
        trail = []
        for _ in range(ROUNDS):
            _round(km, kc, str(tmp_path))
            end = _settled(kc, kernel_process, listening, start)
            trail.append((end["threads"], end["fds"], len(end["listeners"]), round(end["pss"] / 2**20, 1)))
            figures = {k: (start[k], end[k]) for k in start}
            assert end["threads"] <= start["threads"] and end["fds"] <= start["fds"], figures
            assert end["listeners"] == [], figures
        print(f"soak, {ROUNDS} rounds after warm-up: {figures}; after each round (threads, fds, listeners, "
              f"own PSS MiB): {trail}")
        assert end["pss"] - start["pss"] < PSS_BOUND, figures
