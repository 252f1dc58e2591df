"""GPU reservations: no two jobs on the machine get the same GPU; a killed kernel frees its GPUs; --wait; --force.

The GPUs are the NVML fake's (tests/fake_nvml.py); the reservations, processes and kernels are real: the lock files
live in this run's private folder ($DDP_NOTEBOOK_RESERVATIONS, set by conftest.py and inherited by kernels).  Ranks
of a job on a fake GPU run on the CPU (gloo): this machine has no CUDA, and the GPU is only named.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import fake_nvml
from conftest import ROOT
from ddp_notebook.engine import devices as gpus, reservations, spec as job_spec
from ddp_notebook.notebook import picker
from ddp_notebook.wire.errors import LaunchError
from nbrun import kernel

TESTS = os.path.dirname(os.path.abspath(__file__))
# (These kernels reserve GPUs and refuse cells; the one job whose ranks start needs no rank template.)
FREE2 = f"""
%env DDP_NOTEBOOK_TEMPLATE=0
import sys; sys.path.insert(0, {TESTS!r})
import fake_nvml
from ddp_notebook.engine import devices as gpus
gpus._nvml_override = fake_nvml.free2()
%load_ext ddp_notebook
"""


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.setenv(reservations.DIR_ENV, str(tmp_path / "reservations"))
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(job_spec, "_default_devices", None)
    monkeypatch.setattr(picker, "_active", None)


def _holder(uuids):
    """Another process that holds ``uuids``; ends when killed."""
    code = ("import sys, time; from ddp_notebook.engine import reservations\n"
            f"r, taken = reservations.reserve({uuids!r}); assert not taken, taken\n"
            "print('HELD', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path)))
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def _end(proc):
    proc.kill()
    proc.wait(10)


def test_another_process_s_gpu_is_refused_by_name_shared_with_force_and_skipped_by_count(server):
    other = _holder([fake_nvml.UUIDS[1]])
    try:
        held = reservations.holders(fake_nvml.UUIDS[:3])
        assert held[fake_nvml.UUIDS[0]] is None and held[fake_nvml.UUIDS[2]] is None
        assert held[fake_nvml.UUIDS[1]].pid == other.pid
        with pytest.raises(LaunchError, match=rf"GPU 1 is reserved by \w+'s -c \(pid {other.pid}\) since "
                                              r"\d\d:\d\d\. Choose others .* or share it anyway with --force"):
            job_spec.resolve_devices("1,3")
        assert reservations.holders([fake_nvml.UUIDS[3]])[fake_nvml.UUIDS[3]] is None  # all or nothing
        shared = job_spec.resolve_devices("1,3", force=True)
        assert shared.gpus == [fake_nvml.UUIDS[1], fake_nvml.UUIDS[3]] and f"(pid {other.pid})" in shared.notes[0]
        assert shared.reservation.uuids == [fake_nvml.UUIDS[3]]  # the one it could take
        shared.release_devices()
        counted = job_spec.resolve_devices(2)  # the least busy are 3 and 1; 1 is taken: 3 and 6
        assert counted.gpus == [fake_nvml.UUIDS[3], fake_nvml.UUIDS[6]] and "free of other jobs" in counted.notes[0]
        assert reservations.holders([fake_nvml.UUIDS[3]])[fake_nvml.UUIDS[3]].pid == os.getpid()
        counted.release_devices()
        assert reservations.holders([fake_nvml.UUIDS[3]])[fake_nvml.UUIDS[3]] is None
        table = gpus.table(gpus.discover())
        assert "reserved by" in table.splitlines()[2] and f"(pid {other.pid})" in table.splitlines()[2]
    finally:
        _end(other)
    assert reservations.holders([fake_nvml.UUIDS[1]])[fake_nvml.UUIDS[1]] is None  # killed: released by itself
    job_spec.resolve_devices("1,").release_devices()


def test_the_picker_shows_reservations_and_does_not_tick_reserved_gpus(server):
    other = _holder([fake_nvml.UUIDS[3]])
    try:
        panel = picker.gpu_picker()
        row = panel.rows.children[3].children[1].value
        assert "reserved by" in row and f"(pid {other.pid})" in row
        assert panel.checkboxes[3].value is False and panel.checkboxes[1].value is True  # free and idle: ticked
    finally:
        _end(other)


def test_waiting_line_is_first_come_first_served_and_skips_a_killed_waiter(server):
    code = ("import time; from ddp_notebook.engine import reservations\n"
            "line = reservations.WaitingLine(); print('WAITING', flush=True); time.sleep(600)")
    killed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path)))
    assert killed.stdout.readline().strip() == "WAITING"
    first = reservations.WaitingLine()
    second = reservations.WaitingLine()
    assert not first.my_turn()  # the other process came first
    _end(killed)
    assert first.my_turn() and not second.my_turn()
    first.leave()
    assert second.my_turn()
    second.leave()
    assert [n for n in os.listdir(reservations.folder()) if n.startswith("waiting-")] == []


RACE = """
import json, os, time
from ddp_notebook import api
def seen(name):
    while not os.path.exists(os.path.join({folder!r}, name)):
        time.sleep(0.001)
took = []
for r in range(50):
    seen(f"go-{{r}}")
    spec = api.plan(None, gpus="1")          # what %%ddp --gpus 1 does before its ranks start
    took.append(spec.gpus[0])
    open(os.path.join({folder!r}, f"took-{{r}}-{me}"), "w").close()
    seen(f"took-{{r}}-{other}")               # both hold theirs at once
    spec.release_devices()                   # as the job's end does
    open(os.path.join({folder!r}, f"released-{{r}}-{me}"), "w").close()
print("TOOK", json.dumps(took))
"""


def _reply(kc, msg_id, timeout=120):
    out, deadline = "", time.time() + timeout
    while True:
        msg = kc.get_iopub_msg(timeout=max(1, deadline - time.time()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out += msg["content"]["text"]
        elif msg["msg_type"] == "error":
            out += "\n".join(msg["content"]["traceback"])
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return out


@pytest.mark.kernel
@pytest.mark.timeout(240)
def test_two_kernels_racing_for_one_gpu_get_different_gpus_50_times(tmp_path):
    folder = str(tmp_path)
    with kernel(FREE2) as (_, first), kernel(FREE2) as (_, second):
        ids = [kc.execute(RACE.format(folder=folder, me=me, other=1 - me)) for me, kc in enumerate((first, second))]
        for r in range(50):
            if r:
                for me in (0, 1):
                    while not os.path.exists(os.path.join(folder, f"released-{r - 1}-{me}")):
                        time.sleep(0.001)
            open(os.path.join(folder, f"go-{r}"), "w").close()
        outs = [_reply(kc, msg_id) for kc, msg_id in zip((first, second), ids)]
    took = [json.loads(re.search(r"TOOK (.*)", out).group(1)) for out in outs]
    assert len(took[0]) == len(took[1]) == 50, outs
    # (GPU UUIDs: what the ranks are given)
    assert all({a, b} == {fake_nvml.UUIDS[0], fake_nvml.UUIDS[1]} for a, b in zip(*took)), took


HOLD = """
from ddp_notebook import api
spec = api.plan(None, gpus="1", wait={wait})  # what %%ddp --gpus 1 --wait does before its ranks start
print("HOLDS", spec.gpus[0])
"""


def _stream_until(kc, msg_id, text):
    said = ""
    while text not in said:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            said += msg["content"]["text"]
    return said


@pytest.mark.kernel
@pytest.mark.timeout(240)
def test_wait_takes_a_gpu_once_released_is_interruptible_and_a_killed_kernel_frees_its_gpus(no_leftovers):
    both = fake_nvml.UUIDS[:2]
    with kernel(FREE2) as (km, kc):
        mine, taken = reservations.reserve(both)  # this process holds both GPUs
        assert not taken
        msg_id = kc.execute(HOLD.format(wait='float("inf")'))
        said = _stream_until(kc, msg_id, "waiting for 1 GPU: 2 busy")
        mine.release()
        mine, taken = reservations.reserve([both[0]])  # GPU 1 alone comes free
        out = said + _reply(kc, msg_id)
        assert "GPUs free after" in out and f"HOLDS {fake_nvml.UUIDS[1]}" in out, out
        assert reservations.holders([both[1]])[both[1]].pid == km.provisioner.process.pid

        # Waiting for a second GPU (both held), then interrupted: nothing taken, no ticket left behind.
        msg_id = kc.execute("%%ddp --gpus 1 --wait 5 --backend gloo\nprint('RAN')")
        _stream_until(kc, msg_id, "waiting for 1 GPU")
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        assert [n for n in os.listdir(reservations.folder()) if n.startswith("waiting-")] == []
        mine.release()

        # The kernel still holds GPU 1 (its `spec`): killed, it lets it go by itself.
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        km.provisioner.process.wait(10)
        assert reservations.holders(both) == {both[0]: None, both[1]: None}


@pytest.mark.kernel
@pytest.mark.timeout(120)
def test_wait_and_force_flags_are_checked_before_anything_starts(no_leftovers):
    with kernel(FREE2) as (_, kc):
        out = _reply(kc, kc.execute("%%ddp --cpus 2 --wait\nprint('RAN')"))
        assert "--wait waits for GPUs (--gpus N); CPU ranks need no waiting" in out and "RAN" not in out
        out = _reply(kc, kc.execute("%%ddp --gpus 0,1 --wait\nprint('RAN')"))
        assert "--wait waits for a count of GPUs (--gpus N), not for GPUs named by index" in out
        other = _holder([fake_nvml.UUIDS[0]])
        try:
            out = _reply(kc, kc.execute("%%ddp --gpus 0, --backend gloo\nprint('RAN')"))
            assert "GPU 0 is reserved by" in out and f"(pid {other.pid})" in out and "RAN" not in out
            # --force shares it; the ranks then start (and, with the CPU build of torch here, say so clearly).
            out = _reply(kc, kc.execute("%%ddp --gpus 0, --force --backend gloo\nprint('RAN')"))
            assert "sharing with another kernel's job (--force)" in out
            assert f"the job was given a GPU (CUDA_VISIBLE_DEVICES={fake_nvml.UUIDS[0]}), but this torch is built " \
                   "without CUDA" in out, out
        finally:
            _end(other)


def test_wait_gives_up_after_its_minutes_naming_how_many_are_taken(server, capsys):
    other = _holder(fake_nvml.UUIDS)
    try:
        with pytest.raises(LaunchError, match=rf"1 GPU did not become free within 0.001 min \(8 of 8 busy or reserved; "
                                              rf"reserved: GPU 0, 1, 2, 3, 4, 5, 6, 7: \w+'s -c \(pid {other.pid}\) "):
            job_spec.resolve_devices(1, wait=0.001)
        assert "waiting for 1 GPU: 8 busy — 0:00:00" in capsys.readouterr().err
    finally:
        _end(other)


def test_an_interrupt_between_reserving_gpus_and_making_the_job_gives_them_back(server, monkeypatch):
    """launch() reserves the GPUs as it plans the job, then reads the function's source and makes the job: an
    interrupt (Jupyter's stop button) or an error in between must not keep them from every other job until the
    kernel ends."""
    import ddp_notebook
    from ddp_notebook import api

    def interrupted(fn):
        raise KeyboardInterrupt

    monkeypatch.setattr(api.payload, "sources_for", interrupted)
    with pytest.raises(KeyboardInterrupt) as interrupted:
        ddp_notebook.launch(len, ("ab",), gpus="1,2")
    # Kept, as IPython keeps the last traceback (sys.last_traceback) and with it the call's frames until the next
    # error: the GPUs must go back before that, not when the job's plan is collected.
    assert interrupted.tb is not None
    assert reservations.holders(fake_nvml.UUIDS[1:3]) == {uuid: None for uuid in fake_nvml.UUIDS[1:3]}
