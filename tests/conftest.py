import os
import subprocess
import sys

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# A pytest-xdist worker (``-n``) inherits the controller's environment: it takes a tag, a temp dir and a
# reservations file of its own below, so that what one worker counts as its leftovers is never another's.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if WORKER and os.environ.get("DDP_NOTEBOOK_TEST_WORKER") != WORKER:
    os.environ["DDP_NOTEBOOK_TEST_WORKER"] = WORKER
    os.environ.pop("DDP_NOTEBOOK_TEST_TAG", None)
    os.environ.pop("DDP_NOTEBOOK_TEST_TMPDIR", None)
    os.environ.pop("DDP_NOTEBOOK_RESERVATIONS", None)
# Ranks inherit the environment: this tag tells our ranks from those of other runs on the machine.
TEST_TAG = os.environ.setdefault("DDP_NOTEBOOK_TEST_TAG", __import__("uuid").uuid4().hex)
# A private temp dir for this run (kernels and ranks inherit it), so leftovers are ours to count.
if not os.environ.get("DDP_NOTEBOOK_TEST_TMPDIR"):
    import tempfile

    os.environ["DDP_NOTEBOOK_TEST_TMPDIR"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="ddp-tests-")
    tempfile.tempdir = None
# GPU reservations (engine/reservations.py) of this run's fake GPUs stay in it, away from the machine's own.
os.environ.setdefault("DDP_NOTEBOOK_RESERVATIONS", os.path.join(os.environ["DDP_NOTEBOOK_TEST_TMPDIR"], "gpu-reservations"))
# Where PYTHONDONTWRITEBYTECODE is set (this machine and CI set it), every kernel, rank template, fresh rank and
# worker would compile the package from source (0.2 CPU-s each, several hundred processes a run) and each worker
# would rewrite every test module again: the bytecode is written once, before any worker starts, and pytest keeps
# the test modules it rewrote.  The processes read it as they would have read their own.
sys.dont_write_bytecode = False
if not WORKER:
    import compileall

    for _folder in ("ddp_notebook", "tests", "benchmarks"):
        compileall.compile_dir(os.path.join(ROOT, _folder), quiet=1)


# The modules that take longest here (wall seconds in one process, from DDP_NOTEBOOK_TEST_CPU_LOG) are handed out
# first, so that pytest-xdist's workers do not end with one of them left alone on one worker while the others idle.
LONGEST_FIRST = {
    "test_slurm.py": 170, "test_docs.py": 82, "test_interrupts.py": 66, "test_torchrun.py": 60, "test_hangs.py": 57,
    "test_dashboard_kernel.py": 46, "test_pool.py": 44, "test_faults.py": 43, "test_dashboard_browser.py": 43,
    "test_stopping.py": 41, "test_background_memory.py": 40, "test_shared_results.py": 38, "test_debugger.py": 30,
    "test_sharded_results.py": 30, "test_lost_writes.py": 27, "test_hf_datasets.py": 26,
    "test_template_environment.py": 26, "test_benchmarks_smoke.py": 26, "test_template_preload.py": 25,
    "test_checkpoint_background.py": 24, "test_gpu_check.py": 23, "test_template.py": 23,
    "test_background_browser.py": 23, "test_output.py": 22, "test_picker_browser.py": 21,
    "test_checkpoint_sharded.py": 21, "test_debugger_browser.py": 18, "test_soak.py": 17, "test_sharing.py": 17,
}


def run_group(nodeid: str) -> str:
    """What runs on one pytest-xdist worker, one test after the other: a module (its tests share their module's
    kernel and fixtures, and may count what their module left), or all the browser tests (one Chromium at a time).
    The Slurm tests, which share the machine's daemons, are one module (checked at collection)."""
    module = nodeid.split("::")[0]
    return "browser" if module.endswith("_browser.py") else module


def pytest_collection_modifyitems(config, items):
    """The longest groups first (a stable sort: the others keep their order); the same order in one process."""
    elsewhere = [item.nodeid for item in items if "slurm" in getattr(item, "fixturenames", ())
                 and os.path.basename(item.nodeid.split("::")[0]) != "test_slurm.py"]
    if elsewhere:
        raise pytest.UsageError(f"Slurm tests belong in tests/test_slurm.py (one worker owns the daemons): {elsewhere}")
    cost: dict[str, int] = {}
    for group, module in {(run_group(item.nodeid), item.nodeid.split("::")[0]) for item in items}:
        cost[group] = cost.get(group, 0) + LONGEST_FIRST.get(os.path.basename(module), 0)
    items.sort(key=lambda item: -cost[run_group(item.nodeid)])


def pytest_collection_finish(session):
    """What collection imported (torch, datasets, transformers, the test modules: some 490,000 objects) is never
    garbage: frozen, it no longer makes each full collection take 0.2 s (tests that check what the collector frees
    call it after every example)."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (``-n 3``, the default in pyproject.toml), hand out :func:`run_group`'s groups whole, in
    the order collected.  (pytest-xdist's own ``--dist loadgroup`` names a test by its group in a way pytest 9.2
    ignores, so its groups were spread over the workers.)"""
    if config.getvalue("dist") not in ("load", "loadgroup", "loadscope", "loadfile"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return run_group(nodeid)

    config.option.loadscopereorder = False  # (it would put the groups with most tests first, not the longest)
    return GroupScheduling(config, log)


CPU_LOG = os.environ.pop("DDP_NOTEBOOK_TEST_CPU_LOG", None)  # (a pytest these tests start logs nothing twice)


def _machine_counts() -> tuple[float, int]:
    """CPU-seconds the whole machine has spent busy since boot (every process: kernels, ranks, browsers, daemons),
    and the processes and threads it has made."""
    with open("/proc/stat") as handle:
        lines = handle.read().splitlines()
    fields = [int(field) for field in lines[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    made = next(int(line.split()[1]) for line in lines if line.startswith("processes "))
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK"), made


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``DDP_NOTEBOOK_TEST_CPU_LOG=path``, one line a test: its wall time, the machine's CPU-seconds and the
    processes and threads made meanwhile (what the suite's time is made of; run in one process, ``-n 0``, on an
    otherwise idle machine: the machine's counts cannot tell two workers' tests apart, and workers never see it)."""
    log = CPU_LOG
    if not log:
        yield
        return
    import time

    started, (busy, made) = time.monotonic(), _machine_counts()
    yield
    busy_now, made_now = _machine_counts()
    with open(log, "a") as handle:
        handle.write(f"{time.monotonic() - started:.2f}\t{busy_now - busy:.2f}\t{made_now - made}\t{item.nodeid}\n")


def rank_processes():
    """Every live ddp_notebook rank of this test run (by its command line and the run's tag in its environment)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = proc.info["cmdline"] or []
            # A rank forked from the template has its command line as one string (a process title).
            if ("ddp_notebook.rank.worker" in " ".join(cmd) or "ddp_notebook.worker" in cmd) \
                    and proc.info["status"] != psutil.STATUS_ZOMBIE \
                    and proc.environ().get("DDP_NOTEBOOK_TEST_TAG") == TEST_TAG:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def job_dirs():
    import tempfile

    base = tempfile.gettempdir()
    return {d for d in os.listdir(base) if d.startswith("ddp_notebook-")}


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves a rank, a zombie child or a job directory behind."""
    before_dirs = job_dirs()
    yield
    import time

    deadline = time.time() + 5
    while rank_processes() and time.time() < deadline:
        time.sleep(0.1)
    assert rank_processes() == []
    me = psutil.Process()
    zombies = [c for c in me.children(recursive=True) if c.status() == psutil.STATUS_ZOMBIE]
    assert zombies == []
    assert job_dirs() - before_dirs == set()



def pytest_sessionfinish(session, exitstatus):
    import shutil

    private = os.environ.get("DDP_NOTEBOOK_TEST_TMPDIR", "")
    if os.path.basename(private).startswith("ddp-tests-"):
        shutil.rmtree(private, ignore_errors=True)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 128 KiB tmpfs (root only; CI runs as root, so there a failed mount fails the test)."""
    where = tmp_path / "small"
    where.mkdir()
    ci = os.environ.get("CI", "").lower() == "true"
    if os.geteuid() != 0:
        if ci:
            pytest.fail("CI must run as root to mount the tmpfs this test fills")
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        if ci:
            pytest.fail(f"cannot mount a tmpfs: {mounted.stderr}")
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
