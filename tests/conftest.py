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


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``), tests that share something machine-wide run on one worker:
    the Slurm daemons, Chromium."""
    for item in items:
        if "slurm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif item.get_closest_marker("browser") is not None:
            item.add_marker(pytest.mark.xdist_group("browser"))


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
    processes and threads made meanwhile (what the suite's time is made of; run alone on an otherwise idle machine)."""
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
