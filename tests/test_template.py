"""The rank template: ranks forked from it are what fresh ranks are, and it never outlives its notebook.

Real ranks over gloo, forked from a real template process started by this test process (the kernel tests and
every fault and leak test run with the template on as well: it is the default).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import ddp_notebook
from ddp_notebook.engine import template
from nbrun import execute, gone, kernel, start_kernel

pytestmark = pytest.mark.timeout(180)


def _what_a_rank_sees():
    import gc
    import os
    import signal
    import sys

    import psutil
    import torch

    return {
        "pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "pgid": os.getpgrp(),
        "cwd": os.getcwd(), "sys_path": list(sys.path), "threads": torch.get_num_threads(),
        "omp": os.environ["OMP_NUM_THREADS"], "late": os.environ.get("DDP_NOTEBOOK_TEST_LATE"),
        "set": os.environ.get("DDP_NOTEBOOK_TEST_SET"),
        "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "cuda_initialized": torch.cuda.is_initialized(),
        "cmdline": psutil.Process().cmdline(), "argv0": sys.argv[0],
        "tag": psutil.Process().environ().get("DDP_NOTEBOOK_TEST_TAG"),  # what the leak checks find ranks by
        # the template's own handling of its children's ends is not a rank's
        "signals": {sig.name: repr(signal.getsignal(sig)) for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE)},
        "wakeup_fd": signal.set_wakeup_fd(-1),
        # user code runs with the collector on, and no collection walks what the rank imported (rank/heap.py)
        "collector": {"enabled": gc.isenabled(), "torch_frozen": gc.get_freeze_count() > len(sys.modules) * 100,
                      "torch_walked": any(obj is torch.__dict__ for obj in gc.get_objects())},
    }


def _fresh_template():
    template.stop()
    started = template.ready_template()
    assert started is not None
    return started.proc.pid


def test_a_forked_rank_takes_the_session_environment_directory_and_path_of_now(tmp_path, monkeypatch, no_leftovers):
    template_pid = _fresh_template()
    # Changed after the template started: the rank must see the kernel as it is now.
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DDP_NOTEBOOK_TEST_LATE", "set after the template started")
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert template.current_pid() == template_pid
    for rank, rank_saw in enumerate(seen):
        assert rank_saw["ppid"] == template_pid  # forked, not started fresh
        assert rank_saw["sid"] == rank_saw["pgid"] == rank_saw["pid"]  # a session and process group of its own
        assert rank_saw["cwd"] == str(tmp_path)
        assert rank_saw["sys_path"][0] == str(tmp_path)
        assert rank_saw["late"] == "set after the template started"
        assert (rank_saw["rank"], rank_saw["world"]) == (str(rank), "2")
        assert rank_saw["threads"] == int(rank_saw["omp"])
        assert rank_saw["cuda_initialized"] is False
        assert rank_saw["tag"] == os.environ["DDP_NOTEBOOK_TEST_TAG"]
        assert rank_saw["signals"]["SIGCHLD"] == repr(signal.SIG_DFL) and rank_saw["wakeup_fd"] == -1
        assert rank_saw["collector"] == {"enabled": True, "torch_frozen": True, "torch_walked": False}
        # It reads as a fresh rank does, to ps and to anything that looks for ranks by their command line.
        assert " ".join(rank_saw["cmdline"]).split()[1:] == \
            template.python_module_command("ddp_notebook.rank.worker")[1:]  # -P: nothing of the working folder
        assert rank_saw["argv0"].endswith(os.path.join("rank", "worker.py"))


def _not_ready_template() -> int:
    """A template just started: importing torch, so not ready for a while on any machine."""
    template.stop()
    started = template.warm_up()
    assert started is not None and not started.ready
    return started.proc.pid


def test_a_background_job_started_as_the_template_imports_forks_its_ranks_from_it_with_the_notebook_of_its_start(
        tmp_path, monkeypatch, no_leftovers):
    before, later = tmp_path / "before", tmp_path / "later"
    before.mkdir()
    later.mkdir()
    monkeypatch.chdir(before)
    monkeypatch.setenv("DDP_NOTEBOOK_TEST_SET", "as the job started")
    monkeypatch.delenv("DDP_NOTEBOOK_TEST_LATE", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.syspath_prepend(str(before))
    template_pid = _not_ready_template()
    job = ddp_notebook.launch(_what_a_rank_sees, cpus=2, background=True)
    assert job.pids == {}  # returned at once: its ranks come once the template is ready
    # The notebook goes on and changes, a variable the template read as it started included (glibc's, which would
    # make the next job's ranks come from a new template); the ranks still start from the notebook as the job
    # started, forked from the template that was coming then.
    monkeypatch.chdir(later)
    monkeypatch.syspath_prepend(str(later))
    monkeypatch.setenv("DDP_NOTEBOOK_TEST_SET", "changed after")
    monkeypatch.setenv("DDP_NOTEBOOK_TEST_LATE", "set after")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    seen = job.wait(timeout=120)
    assert template.current_pid() == template_pid
    for rank, rank_saw in enumerate(seen):
        assert rank_saw["ppid"] == template_pid  # forked from it, not started fresh
        assert rank_saw["cwd"] == str(before)
        assert str(before) in rank_saw["sys_path"] and str(later) not in rank_saw["sys_path"]
        assert rank_saw["set"] == "as the job started"
        assert rank_saw["late"] is None
        assert rank_saw["rank"] == str(rank)
    assert sorted(job.pids) == [0, 1]


def _a_free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_background_job_stopped_before_the_template_is_ready_starts_no_rank_and_the_next_forks(no_leftovers):
    template_pid = _not_ready_template()
    port = _a_free_port()  # (rank 0's store would take over the socket the notebook binds as the job starts)
    job = ddp_notebook.launch(_what_a_rank_sees, cpus=2, port=port, background=True)
    with pytest.raises(OSError):
        socket.create_server(("127.0.0.1", port))  # held for the job's ranks
    job.stop(timeout=30)
    assert job.status == "stopped" and job.pids == {}
    with pytest.raises(ddp_notebook.JobStopped):
        job.wait()
    socket.create_server(("127.0.0.1", port)).close()  # let go with the job
    # The template was not harmed: the next background job, again before it is ready, forks from it.
    assert not template.current().ready
    job = ddp_notebook.launch(_what_a_rank_sees, cpus=2, port=_a_free_port(), background=True)
    assert job.pids == {}
    seen = job.wait(timeout=120)
    assert [rank_saw["ppid"] for rank_saw in seen] == [template_pid] * 2
    assert template.current_pid() == template_pid


def test_a_background_job_whose_template_is_stopped_before_it_is_ready_starts_its_ranks_fresh(no_leftovers):
    _not_ready_template()
    job = ddp_notebook.launch(_what_a_rank_sees, cpus=2, background=True)
    assert job.pids == {}
    template.stop()  # %ddp_stop, as the job's thread waits for it
    seen = job.wait(timeout=120)
    assert [rank_saw["ppid"] for rank_saw in seen] == [os.getpid()] * 2  # fresh, children of the notebook


def test_forked_ranks_see_what_fresh_ranks_see(monkeypatch, no_leftovers):
    _fresh_template()
    forked = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    monkeypatch.setenv("DDP_NOTEBOOK_TEMPLATE", "0")
    fresh = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert {r["ppid"] for r in fresh} == {os.getpid()}  # off: every rank a child of this process
    different = {"pid", "ppid", "sid", "pgid", "cmdline"}  # the interpreter path may be spelt differently
    assert [{k: v for k, v in r.items() if k not in different} for r in forked] == \
        [{k: v for k, v in r.items() if k not in different} for r in fresh]
    assert [" ".join(r["cmdline"]).split()[1:] for r in forked] == [r["cmdline"][1:] for r in fresh]


def test_a_new_template_when_the_package_changes_on_disk_or_the_template_died(tmp_path, monkeypatch, no_leftovers):
    # The package's files as the template reads them, copied with their times: touching the installed package's own
    # file would make every other pytest worker's template look outdated too (and replaced, mid-test).
    package = tmp_path / "ddp_notebook"
    shutil.copytree(template.PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(template, "PACKAGE_DIR", str(package))
    first = _fresh_template()
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert template.current_pid() == first and {r["ppid"] for r in seen} == {first}  # nothing changed: kept
    version_file = package / "version.py"
    stat = version_file.stat()
    os.utime(version_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    second = template.current_pid()
    assert second not in (None, first) and not psutil.pid_exists(first)
    assert {r["ppid"] for r in seen} == {second}

    os.kill(second, signal.SIGKILL)
    _until_dead(second)
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    third = template.current_pid()
    assert third not in (None, second) and {r["ppid"] for r in seen} == {third}
    zombies = [c for c in psutil.Process().children() if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []


def _until_dead(pid: int) -> None:
    """Until the child ``pid`` has died (a zombie: not reaped, as its Popen would reap it)."""
    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"pid {pid} still alive"
        time.sleep(0.01)


def test_a_template_that_dies_as_a_job_comes_leaves_the_job_fresh_ranks_and_the_next_a_new_template(
        monkeypatch, no_leftovers):
    first = _fresh_template()
    fork = template.Template.fork

    def dies_first(self, *args):  # alive when the job chose it; dead by the time it is asked to fork
        if self.proc.returncode is None:  # (rank 1: the template is dead and reaped already)
            os.kill(self.proc.pid, signal.SIGKILL)
            _until_dead(self.proc.pid)
        return fork(self, *args)

    monkeypatch.setattr(template.Template, "fork", dies_first)
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)  # (it raised "could not fork a rank" before)
    assert [r["rank"] for r in seen] == ["0", "1"] and {r["ppid"] for r in seen} == {os.getpid()}  # started fresh
    monkeypatch.setattr(template.Template, "fork", fork)
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    second = template.current_pid()
    assert second not in (None, first) and {r["ppid"] for r in seen} == {second}


def test_stop_ends_the_template_and_the_next_job_starts_another(no_leftovers):
    first = _fresh_template()
    template.stop()
    assert template.current_pid() is None and not psutil.pid_exists(first)
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert {r["ppid"] for r in seen} == {template.current_pid()} and first != template.current_pid()


_DIES_WITH_A_JOB_RUNNING = textwrap.dedent("""
    import os, sys, time
    import ddp_notebook
    from ddp_notebook.engine import template

    def forever(folder):
        import os, time
        with open(os.path.join(folder, os.environ["RANK"]), "w") as f:
            f.write(f"{os.getpid()} {os.getppid()}")
        time.sleep(600)

    folder = sys.argv[1]
    template.ready_template().wait_preloaded()  # (a background job waits for no template: it would start fresh)
    job = ddp_notebook.launch(forever, (folder,), cpus=2, background=True)
    deadline = time.time() + 60
    while len(os.listdir(folder)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    print("TEMPLATE", template.current_pid(), flush=True)
    os.kill(os.getpid(), 9)
""")


def test_the_template_and_its_ranks_go_within_10_s_when_the_notebook_dies(tmp_path, no_leftovers):
    out = subprocess.run([sys.executable, "-c", _DIES_WITH_A_JOB_RUNNING, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    template_pid = int(out.stdout.split()[-1])
    ranks, parents = zip(*[map(int, (tmp_path / name).read_text().split()) for name in ("0", "1")])
    assert set(parents) == {template_pid}  # forked ranks: the notebook is not their parent
    deadline = time.time() + 10
    alive = [template_pid, *ranks]
    while alive and time.time() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert alive == []


_TEMPLATE_PID = "from ddp_notebook.engine import template; print('TEMPLATE', template.current_pid())"
_PARENTS = "%%ddp --cpus 2\nimport os\nprint('PARENT', os.getppid(), flush=True)"


def _numbers(text: str, label: str) -> list[int]:
    return [int(n) for n in re.findall(label + r" (\d+)", text)]


@pytest.mark.kernel
@pytest.mark.slow
def test_in_a_kernel_the_extension_starts_it_ddp_stop_ends_it_and_it_goes_with_the_kernel(no_leftovers):
    with kernel() as (km, kc):
        (started,) = _numbers(execute(kc, [_TEMPLATE_PID]), "TEMPLATE")  # already there after %load_ext
        assert psutil.Process(started).ppid() == km.provisioner.process.pid
        assert set(_numbers(execute(kc, [_PARENTS]), "PARENT")) == {started}
        stopped = execute(kc, ["%ddp_stop", _TEMPLATE_PID])
        assert "TEMPLATE None" in stopped and not psutil.pid_exists(started)
        parents = set(_numbers(execute(kc, [_PARENTS]), "PARENT"))
        (again,) = _numbers(execute(kc, [_TEMPLATE_PID]), "TEMPLATE")
        assert parents == {again} and again != started
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        deadline = time.time() + 10
        while psutil.pid_exists(again) and psutil.Process(again).status() != psutil.STATUS_ZOMBIE \
                and time.time() < deadline:
            time.sleep(0.05)
        assert not psutil.pid_exists(again) or psutil.Process(again).status() == psutil.STATUS_ZOMBIE


# A sitecustomize for the kernel's environment: in the rank template only, ``import torch`` says so and then takes
# two minutes, as on a slow disk, so that the kernel can be killed while the template imports.
_SLOW_TORCH_IN_THE_TEMPLATE = textwrap.dedent("""
    import importlib.abc, os, sys, time

    class SlowTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and "ddp_notebook.rank.template" in sys.orig_argv:
                with open(os.environ["DDP_NOTEBOOK_TEST_IMPORTING"] + ".part", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(os.environ["DDP_NOTEBOOK_TEST_IMPORTING"] + ".part", os.environ["DDP_NOTEBOOK_TEST_IMPORTING"])
                time.sleep(120)
            return None

    sys.meta_path.insert(0, SlowTorch())
""")


@pytest.mark.kernel
def test_the_template_goes_with_a_kernel_killed_while_it_imports(tmp_path, no_leftovers):
    (tmp_path / "sitecustomize.py").write_text(_SLOW_TORCH_IN_THE_TEMPLATE)
    importing = tmp_path / "importing"
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), DDP_NOTEBOOK_TEST_IMPORTING=str(importing))
    km, kc = start_kernel(env)
    template_pid = None
    try:
        kc.execute_interactive("%load_ext ddp_notebook", timeout=60)
        deadline = time.time() + 60
        while not importing.exists() and time.time() < deadline:
            time.sleep(0.05)
        template_pid = int(importing.read_text())
        assert psutil.Process(template_pid).ppid() == km.provisioner.process.pid
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert gone([template_pid], within=10)  # not after its imports, two minutes on
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        if template_pid is not None and psutil.pid_exists(template_pid):
            os.kill(template_pid, signal.SIGKILL)  # (a failed run leaves nothing behind)
