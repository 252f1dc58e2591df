"""``%%ddp --executor`` on a real Slurm (slurmctld, slurmd and munge on this machine, started by the tests).

Outside CI these tests skip, with the reason, when Slurm cannot be started here; under ``CI=true`` they fail.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

import slurm_support
from ddp_notebook.wire import protocol
from nbrun import SharedKernel, gone, kernel, run_answering

pytestmark = [pytest.mark.slow]


# This module's kernels start no rank of their own (their ranks are Slurm's tasks): no rank template, as a
# notebook that only sends jobs to a cluster may choose (it would import torch and go unused: 2 CPU-s a kernel).
SETUP = "%env DDP_NOTEBOOK_TEMPLATE=0\n%load_ext ddp_notebook"


@pytest.fixture(scope="module")
def shared():
    """The kernel this module's tests take in turn (each ends its own jobs; nbrun.SharedKernel)."""
    module_kernel = SharedKernel(SETUP)
    yield module_kernel
    module_kernel.close()


JOB_NAME = "ddp_nb_test"


@pytest.fixture(scope="module")
def slurm():
    why = None
    try:
        import submitit  # noqa: F401
    except ImportError:
        why = "submitit is not installed (pip install -e '.[test]')"
    started = []
    if why is None:
        started, why = slurm_support.start()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Slurm tests need a real Slurm under CI: {why}")
        pytest.skip(why)
    yield
    subprocess.run(["scancel", "--name", JOB_NAME], capture_output=True)
    slurm_support.stop(started)


def test_a_slurm_job_s_port_is_its_own_below_the_ephemeral_ports_unless_the_environment_names_one(monkeypatch):
    """submitit's port (20000-60000) fell among the ports of this machine's own connections: rank 0's TCPStore
    failed with EADDRINUSE in a CI run.  The job's id picks one below them, the same on every node."""
    from ddp_notebook.rank.slurm import master_port

    monkeypatch.delenv("MASTER_PORT", raising=False)
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        first_ephemeral = int(handle.read().split()[0])
    ports = {job: master_port(job) for job in ("444", "445", "123_4", "9999999")}
    assert all(20000 <= port < min(first_ephemeral, 32768) for port in ports.values()), ports
    assert len(set(ports.values())) == 4 and ports == {job: master_port(job) for job in ports}
    monkeypatch.setenv("MASTER_PORT", "12355")  # the seed recipe's, set in the notebook: as submitit, kept
    assert master_port("444") == 12355


def _setup(folder: str, host: str | None = None) -> str:
    """A test's first cell: the user's executor, and (for the file-only mode) an address no rank reaches.  The
    kernel may be the one an earlier test of the module used: what that one set in its environment is cleared."""
    where = (f"os.environ['DDP_NOTEBOOK_HOST'] = {host!r}" if host
             else "os.environ.pop('DDP_NOTEBOOK_HOST', None)")
    return f"import os\n{where}\nos.environ.pop({protocol.STILL_AFTER_ENV!r}, None)\n" + f"""
import time, submitit, torch, ddp_notebook
ex = submitit.AutoExecutor(folder={folder!r})
ex.update_parameters(nodes=1, tasks_per_node=2, cpus_per_task=1, timeout_min=5, slurm_partition="debug",
                     name={JOB_NAME!r})
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 1)
    def forward(self, x):
        return self.fc(x)
x = torch.randn(64, 4)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
arrived = []
def note(record):
    arrived.append(time.time())
"""


TRAIN = """%%ddp --executor ex --return model --callback note --seed 777
import time
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(Net())
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = ddp_notebook.distributed_loader(data, batch_size=8)
for epoch in range(3):
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad(); loss.backward(); opt.step()
    ddp_notebook.report(epoch=epoch, epochs=3, loss=loss.item(), wsum=sum(p.sum().item() for p in model.parameters()))
    print("epoch", epoch, "done on rank", rank, flush=True)
    time.sleep(1.0)
"""

CHECK_TRAIN = """
job = ddp_notebook.last_job()
print("STATE", json.dumps({"epochs": [r["epoch"] for r in job.history], "wsum": job.history[-1]["wsum"],
      "returned": sum(p.sum().item() for p in model.parameters()), "type": type(model).__name__,
      "live_for": job.ended_at - arrived[0], "job": job.group.job_id, "mode": job.group.mode}))
"""

FAILS = """%%ddp --executor ex
import time
ready = True
if rank == 1:
    raise ValueError("broken on purpose")
time.sleep(60)
"""


def _state(output: str) -> dict:
    return json.loads(re.search(r"STATE (\{.*\})", output).group(1))


def _job_id(output: str) -> str:
    return re.search(r"Slurm job (\d+) submitted", output).group(1)


def _leaves_queue(job_id: str, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not slurm_support.in_queue(job_id):
            return True
        time.sleep(0.25)
    return False


def _run(kc, code: str, timeout: int = 180, on_message=None) -> tuple[str, list[dict]]:
    """Execute ``code``; (what it printed and its traceback, every iopub message it caused).  ``on_message`` sees
    each message as it arrives."""
    seen, text = [], []

    def hook(msg):
        seen.append(msg)
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            text.append("\n".join(msg["content"]["traceback"]))

    kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(text)), seen


def _no_staging(tmp_path) -> list[str]:
    return glob.glob(os.path.join(str(tmp_path), "runs", ".ddp_notebook-*"))


@pytest.mark.kernel
def test_a_notebook_model_trains_on_slurm_tasks_over_the_channel(shared, slurm, tmp_path):
    folder = str(tmp_path / "runs" / "%j")
    with shared.take() as (km, kc):
        _run(kc, _setup(folder) + "import json")
        out, _ = _run(kc, TRAIN)
        job_id = _job_id(out)
        assert "the ranks report over this kernel's channel" in out
        assert "[rank 0] epoch 2 done on rank 0" in out and "[rank 1] epoch 2 done on rank 1" in out
        state = _state(_run(kc, CHECK_TRAIN)[0])
        assert state["epochs"] == [0, 1, 2]  # report() records, reduced over both ranks
        assert state["mode"] == "channel"
        assert state["live_for"] > 1.5  # the first record arrived while the job still ran
        assert state["type"] == "Net"  # rank 0's model, unwrapped
        assert state["returned"] == pytest.approx(state["wsum"], rel=1e-5)  # ... with the trained weights
        assert _leaves_queue(job_id, 10)

        out, _ = _run(kc, FAILS)
        failed_job = _job_id(out)
        number = re.search(r"Cell In\[(\d+)\]", out)
        assert "RankError: rank 1 failed: ValueError: broken on purpose" in out
        assert "--- traceback of rank 1 ---" in out
        assert 'raise ValueError("broken on purpose")' in out
        assert number is not None and f'File "Cell In[{number.group(1)}]", line 5, in <module>' in out
        assert _leaves_queue(failed_job, 15)  # rank 0 was still asleep: the job was cancelled

        out, _ = _run(kc, "%%ddp --detach\nprint(1)")
        assert "UsageError: --detach leaves a Slurm job running on its own: it goes with --executor" in out
        out, _ = _run(kc, "%%ddp --executor nothing\nprint(1)")
        assert "UsageError: --executor nothing: no such name in the notebook" in out
        out, _ = _run(kc, "%%ddp --executor ex --cpus 2\nprint(1)")
        assert "UsageError: with an executor, Slurm gives the ranks their hosts, devices and port; drop cpus" in out
    assert _no_staging(tmp_path) == []


ASLEEP = """%%ddp --executor ex --hang-after 2
import time, torch, torch.distributed as dist
dist.all_reduce(torch.ones(1))
if rank == 1:
    time.sleep({seconds})  # ASLEEP
dist.all_reduce(torch.ones(1))
"""

ASK_WHY = """
job = ddp_notebook.last_job()
deadline = time.time() + 60
while time.time() < deadline:
    found = job.why()
    if found.missing:
        break
    time.sleep(0.5)
print("WHY", json.dumps({"missing": found.missing, "waiting": {r: e["name"] for r, e in found.waiting.items()},
                         "text": found.text, "stacks": str(job.stacks())}))
job.stop(timeout=30)
print("STATUS", job.status)
"""


def _told_why(out: str, hang_after: int, asleep_s: int, since: str = r"0:00:\d\d"):
    """The cell's words for an ASLEEP job stuck past --hang-after: rank 0 waits in all_reduce, rank 1 sleeps."""
    return re.search(rf"job #\d+ made no progress for {hang_after} s \(--hang-after\); it goes on\. Why:\n"
                     rf"rank 0 waits in all_reduce #\d+ since {since}\n"
                     rf"rank 1 has not reached it \(its last was #\d+\): it is at cell line 5, "
                     rf"`time.sleep\({asleep_s}\)  # ASLEEP`", out)


@pytest.mark.kernel
def test_a_hang_of_a_slurm_job_is_explained_over_the_channel(shared, slurm, tmp_path):
    """A Slurm task shares no folder with the notebook: job.why() and job.stacks() ask it over the channel, and
    --hang-after says why by itself, with the sleeping rank's cell line."""
    folder = str(tmp_path / "runs" / "%j")
    with shared.take() as (km, kc):
        _run(kc, _setup(folder) + "import json")
        out, _ = _run(kc, ASLEEP.format(seconds=15))
        job_id = _job_id(out)
        assert "the ranks report over this kernel's channel" in out
        assert _told_why(out, hang_after=2, asleep_s=15, since=r"0:00:0\d"), out
        assert "Traceback" not in out and "Error" not in out, out  # the job went on and ended well
        assert _leaves_queue(job_id, 15)

        out, _ = _run(kc, ASLEEP.format(seconds=600).replace("--hang-after 2", "--hang-after 600 --background"))
        asleep_job = _job_id(out)
        out, _ = _run(kc, ASK_WHY, timeout=150)
        found = json.loads(re.search(r"WHY (\{.*\})", out).group(1))
        assert found["missing"] == [1] and found["waiting"] == {"0": "all_reduce"}, found
        assert "no Flight Recorder answer" not in found["text"], found
        assert "rank 1 has not reached it" in found["text"] and "`time.sleep(600)  # ASLEEP`" in found["text"]
        assert re.search(r"rank 0: .*all_reduce.* ← Cell In\[\d+\] line 6", found["stacks"]), found
        assert re.search(r"rank 1: .*Cell In\[\d+\] line 5", found["stacks"]), found
        assert "STATUS stopped" in out, out
        assert _leaves_queue(asleep_job, 15)
    assert _no_staging(tmp_path) == []


@pytest.mark.kernel
def test_unreachable_notebook_the_ranks_report_through_files(shared, slurm, tmp_path):
    folder = str(tmp_path / "runs" / "%j")
    with shared.take() as (km, kc):
        _run(kc, _setup(folder, host="192.0.2.1") + "import json")  # TEST-NET-1: no rank can reach it
        out, _ = _run(kc, TRAIN)
        job_id = _job_id(out)
        assert "no rank could reach this kernel at 192.0.2.1" in out and "reports through files in" in out
        state = _state(_run(kc, CHECK_TRAIN)[0])
        assert state["mode"] == "files"
        assert state["epochs"] == [0, 1, 2]
        assert state["returned"] == pytest.approx(state["wsum"], rel=1e-5)
        run_dir = os.path.join(str(tmp_path), "runs", job_id, f"{job_id}_ddp_notebook")
        assert os.path.exists(os.path.join(run_dir, "metrics-node0.jsonl"))
        assert "[rank 1] epoch 2 done on rank 1" in out  # output from the tasks' logs

        out, _ = _run(kc, FAILS)
        failed_job = _job_id(out)
        number = re.search(r"Cell In\[(\d+)\]", out)
        assert "RankError: rank 1 failed: ValueError: broken on purpose" in out
        assert "--- traceback of rank 1 ---" in out and 'raise ValueError("broken on purpose")' in out
        assert number is not None and f'File "Cell In[{number.group(1)}]", line 5, in <module>' in out
        assert _leaves_queue(failed_job, 15)

        # No one can ask these ranks: one whose collectives stand still writes where it is, and the cell reads it.
        _run(kc, f"os.environ[{protocol.STILL_AFTER_ENV!r}] = '0.5'")
        out, _ = _run(kc, ASLEEP.format(seconds=20).replace("--hang-after 2", "--hang-after 4"))
        asleep_job = _job_id(out)
        assert "reports through files in" in out
        assert _told_why(out, hang_after=4, asleep_s=20), out
        assert _leaves_queue(asleep_job, 15)
    assert _no_staging(tmp_path) == []


LONG = """%%ddp --executor ex
import os, time
import torch.distributed as dist
print("PID", os.getpid(), flush=True)
for step in range(100000):
    dist.all_reduce(torch.ones(1))
    time.sleep(0.01)
"""


def _until_pids(kc, code: str, timeout: float = 90) -> tuple[str, str, set[int]]:
    msg_id = kc.execute(code)
    text, pids, deadline = "", set(), time.time() + timeout
    while len(pids) < 2 and time.time() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]
            pids.update(int(p) for p in re.findall(r"PID (\d+)", text))
    assert len(pids) == 2, text
    return msg_id, _job_id(text), pids


@pytest.mark.kernel
def test_interrupt_cancels_the_slurm_job_and_keeps_the_kernel(shared, slurm, tmp_path):
    with shared.take() as (km, kc):
        _run(kc, _setup(str(tmp_path / "runs" / "%j")))
        msg_id, job_id, pids = _until_pids(kc, LONG)
        interrupted = time.monotonic()
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert _leaves_queue(job_id, 15 - (time.monotonic() - interrupted))
        assert gone(pids, within=5)
        out, _ = _run(kc, "print('still fine', 1 + 1)")
        assert "still fine 2" in out
    assert _no_staging(tmp_path) == []


@pytest.mark.kernel
def test_a_killed_kernel_ends_its_slurm_job(slurm, tmp_path):
    with kernel(SETUP) as (km, kc):
        _run(kc, _setup(str(tmp_path / "runs" / "%j")))
        _, job_id, pids = _until_pids(kc, LONG)
        killed = time.monotonic()
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
        assert _leaves_queue(job_id, 30)  # the ranks noticed the lost channel
        assert time.monotonic() - killed < 30
        assert gone(pids, within=5)


@pytest.mark.kernel
def test_a_kernel_killed_while_its_job_is_queued_leaves_nothing_to_run(slurm, tmp_path):
    blocker = subprocess.run(["sbatch", "--parsable", "-n", "2", "--job-name", JOB_NAME, "--output", "/dev/null",
                              "--wrap", "sleep 20"], capture_output=True, text=True, check=True).stdout.strip()
    with kernel(SETUP) as (km, kc):
        _run(kc, _setup(str(tmp_path / "runs" / "%j")) + "import ddp_notebook.engine.slurm as slurm_backend\n"
                 "slurm_backend.HEARTBEAT_STALE_S = 8")
        msg_id = kc.execute(LONG)
        text, deadline = "", time.time() + 30
        while "submitted" not in text and time.time() < deadline:
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
                text += msg["content"]["text"]
        job_id = _job_id(text)
        assert slurm_support.queue_state(job_id) == "PENDING"
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert _leaves_queue(blocker, 30)
    assert _leaves_queue(job_id, 30)  # it started, found the kernel gone, and ran nothing
    log = open(os.path.join(str(tmp_path), "runs", job_id, f"{job_id}_0_log.err")).read()
    assert "the notebook that submitted this job stopped answering" in log and "the cell is not run" in log
    assert "PID" not in open(os.path.join(str(tmp_path), "runs", job_id, f"{job_id}_0_log.out")).read()
    assert _no_staging(tmp_path) == []


DETACHED = """%%ddp --executor ex --detach
import time
for epoch in range(3):
    ddp_notebook.report(epoch=epoch, epochs=3, loss=1.0 / (epoch + 1) + rank)
    time.sleep(0.5)
"""


@pytest.mark.kernel
def test_a_detached_job_is_followed_from_another_kernel(shared, slurm, tmp_path):
    with shared.take() as (km, kc):
        _run(kc, _setup(str(tmp_path / "runs" / "%j")))
        started = time.monotonic()
        reply_seen = []
        kc.execute_interactive(DETACHED, timeout=60, output_hook=reply_seen.append)
        returned_after = time.monotonic() - started
        shown = "".join(json.dumps(m["content"]) for m in reply_seen)
        job_id = re.search(r"Slurm job (\d+): 2 ranks", shown).group(1)
        assert "ddp_notebook.follow(" in shown
    assert returned_after < 10  # the cell did not wait for the job
    assert _leaves_queue(job_id, 90)  # it ran on its own, with no kernel at all
    folder = os.path.join(str(tmp_path), "runs", job_id)
    with kernel(SETUP) as (km, kc):
        out, _ = _run(kc, f"import ddp_notebook\nrun = ddp_notebook.follow({folder!r})\n"
                          f"print('FOLLOWED', run.status, [(r['epoch'], round(r['loss'], 4)) for r in run.history])")
    assert "FOLLOWED done [(0, 1.5), (1, 1.0), (2, 0.8333)]" in out  # each epoch's loss, averaged over the ranks
    assert _no_staging(tmp_path) == []  # the ranks removed the export once loaded


@pytest.mark.kernel
def test_a_queued_job_says_so_then_runs(shared, slurm, tmp_path):
    # The node's 2 CPUs go to another job first: ours waits for Resources, and says so, until that job is cancelled.
    blocker = subprocess.run(["sbatch", "--parsable", "-n", "2", "--job-name", JOB_NAME, "--output", "/dev/null",
                              "--wrap", "sleep 120"], capture_output=True, text=True, check=True).stdout.strip()
    released = []

    def release_once_queued(msg):
        if not released and re.search(r"queued: Slurm job \d+ \(Resources\)", json.dumps(msg["content"])):
            released.append(subprocess.run(["scancel", blocker], check=True))

    try:
        with shared.take() as (km, kc):
            _run(kc, _setup(str(tmp_path / "runs" / "%j")) + "import json")
            out, seen = _run(kc, TRAIN, on_message=release_once_queued)
            assert released  # it said it was queued, and ran once the CPUs were free
            job_id = _job_id(out)
            shown = "".join(json.dumps(m["content"]) for m in seen)  # the dashboard's updates, as the page gets them
            assert re.search(rf"queued: Slurm job {job_id} \(Resources\), 0:0\d", shown), shown[:2000]
            state = _state(_run(kc, CHECK_TRAIN)[0])
            assert state["epochs"] == [0, 1, 2]
    finally:
        subprocess.run(["scancel", blocker])  # a failure above must not leave the node taken for later tests
    assert _leaves_queue(blocker, 15)


def test_big_tensors_travel_as_a_memory_mapped_file(slurm, tmp_path):
    import submitit
    import torch

    import ddp_notebook

    executor = submitit.AutoExecutor(folder=str(tmp_path / "runs" / "%j"))
    executor.update_parameters(nodes=1, tasks_per_node=2, cpus_per_task=1, timeout_min=5, slurm_partition="debug",
                               name=JOB_NAME)
    big = torch.randn(1_000_000, dtype=torch.float64)
    column = torch.arange(2_000_000, dtype=torch.int32).reshape(1000, 2000).t()  # a non-contiguous view

    def digest(a, b):
        return a.sum().item(), a[123_456].item(), b.contiguous().tolist()[7][:5], b.shape, b.is_contiguous()

    values = ddp_notebook.launch(digest, (big, column), executor=executor)
    expected = (big.sum().item(), big[123_456].item(), column.contiguous().tolist()[7][:5], column.shape, False)
    assert values == [expected, expected]
    shipped = ddp_notebook.last_job().group.shipped
    assert shipped["arrays"] >= big.nbytes + column.nbytes  # in the file the ranks map ...
    assert shipped["payload"] < 100_000  # ... not in the pickle
    assert _no_staging(tmp_path) == []


def test_executor_refusals_name_the_culprit(monkeypatch, tmp_path):
    import ddp_notebook
    from ddp_notebook import LaunchError

    before = {child.pid for child in psutil.Process().children()}  # (the rank template may run already)
    with pytest.raises(LaunchError, match="--executor takes a submitit executor.*not object"):
        ddp_notebook.launch(print, executor=object())
    with pytest.raises(LaunchError, match="detach=True leaves a Slurm job running on its own: it goes with "
                                          "executor="):
        ddp_notebook.launch(print, detach=True)
    pytest.importorskip("submitit")
    import submitit

    local = submitit.AutoExecutor(folder=str(tmp_path), cluster="local")
    with pytest.raises(LaunchError, match="runs jobs on 'local', not on Slurm"):
        ddp_notebook.launch(print, executor=local)
    monkeypatch.setitem(sys.modules, "submitit", None)  # as if it were not installed
    with pytest.raises(LaunchError, match=r"submitit, which is not installed .*pip install 'ddp_notebook\[slurm\]'"):
        ddp_notebook.launch(print, executor=local)
    assert {child.pid for child in psutil.Process().children()} <= before  # nothing was started


# (The debugger's Slurm case lives here, with the other tests of the module's daemons.)
SLURM_CELL = """%%ddp --executor ex
value = 40 + rank
if rank == 1:
    breakpoint()
print("after", rank)
"""


@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.timeout(300)
def test_a_slurm_task_prompts_in_the_notebook_and_one_reporting_through_files_says_it_cannot(shared, slurm,
                                                                                              tmp_path):
    from test_debugger import debugger_text

    with shared.take() as (km, client):
        run_answering(client, _setup(str(tmp_path / "runs" / "%j")), [])
        reply, told, prompts = run_answering(client, SLURM_CELL, ["p value", "c"], timeout=200)
        assert reply["status"] == "ok", told
        assert prompts == ["(Pdb rank 1) "] * 2 and "\n41\n" in debugger_text(told)
        assert "[rank 0] after 0" in told and "[rank 1] after 1" in told
    with shared.take() as (km, client):  # no rank reaches the notebook: they report through files
        run_answering(client, _setup(str(tmp_path / "files" / "%j"), host="192.0.2.1"), [])
        reply, told, prompts = run_answering(client, SLURM_CELL, [], timeout=200)
        assert reply["status"] == "error" and prompts == []
        assert "RuntimeError: input() in a rank: this rank has no connection to the notebook (it reports through " \
               "files), so no prompt can reach anyone" in told, told
