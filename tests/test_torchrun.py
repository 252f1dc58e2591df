"""Past one machine: exported cells under real torchrun agents acting as nodes, follow() in a real kernel,
the notebook as node 0 of a two-node job, the version check, and the channel's key."""
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError

import nbformat
import psutil
import pytest
from nbclient import NotebookClient

import ddp_notebook
from ddp_notebook import RankError
from ddp_notebook.wire import channel
from ddp_notebook.notebook import following
from ddp_notebook.wire import protocol
from nbrun import error, kernel_manager, run_cells, text
from torchrun_tasks import (fails_on_node_1, nothing, one_asleep_before_all_reduce, reports_then_rank_1_fails,
                            sleeps, with_arrays)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"

SETUP = """\
%load_ext ddp_notebook
import torch
import ddp_notebook
torch.manual_seed(0)
X = torch.randn(4096, 64)  # 1 MiB: written beside the payload and memory-mapped by the ranks
Y = X @ torch.randn(64, 1)

class Linear(torch.nn.Module):  # a notebook class: travels by value
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 1, bias=False)

    def forward(self, x):
        return self.fc(x)
"""

TRAIN = """\
%%ddp {flags}
import os, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_notebook import report, Sum
from ddp_notebook.wire import protocol
probe = torch.tensor([float(rank + 1)])
dist.all_reduce(probe)
model = DDP(Linear().to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
xs, ys = X[rank::world_size], Y[rank::world_size]
for epoch in range(1, 6):
    for i in range(0, len(xs), 256):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs[i:i + 256]), ys[i:i + 256])
        loss.backward()
        opt.step()
    w = model.module.fc.weight.detach()
    lo, hi = w.clone(), w.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN)
    dist.all_reduce(hi, dist.ReduceOp.MAX)
    mapped = "arrays.bin" in open("/proc/self/maps").read()
    report(epoch=epoch, epochs=5, loss=loss.item(), world=world_size, probe=probe.item(),
           nodes=Sum(int(os.environ["GROUP_RANK"])), ranks=Sum(1), spread=(hi - lo).abs().max().item(),
           mapped=mapped)
    time.sleep(0.3)
final_w = model.module.fc.weight.detach()
print(f"rank {{rank}} of {{world_size}} on node {{os.environ['GROUP_RANK']}} finished")
"""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _agent(args, cwd, log):
    """A torchrun agent, as on another host: its own session, its own working directory."""
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *map(str, args)], cwd=cwd,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _node_1(port, script, cwd, log_path):
    """Node 1 of a job on two hosts, one rank, as another host runs it: (its agent, its log, open)."""
    log = open(log_path, "w+")
    return _agent(["--nnodes", 2, "--node-rank", 1, "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
                   "--master-port", port, script], cwd, log), log


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            try:
                strays = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                strays = []
            for p in [proc, *strays]:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except (ProcessLookupError, psutil.Error):
                    pass
        proc.wait(10)


def _running(path):
    """Processes (agents, ranks) whose command line names the exported script."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if path in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            pass
    return found


def _printed(cell, tag):
    for line in text(cell).splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise AssertionError(f"no {tag} line in:\n{text(cell)}")


def _check_training(history, world):
    assert [r["epoch"] for r in history] == [1, 2, 3, 4, 5]
    for record in history:
        assert record["world"] == world  # one process group over both nodes
        assert record["probe"] == sum(range(1, world + 1))  # an all_reduce across them
        assert record["nodes"] == 1 and record["ranks"] == world  # node 0 and node 1 both reported
        assert record["spread"] == 0.0  # DDP kept the replicas identical
        assert record["mapped"] == 1.0  # the big tensor is memory-mapped from the export's array file
        assert "partial" not in record
    assert history[-1]["loss"] < history[0]["loss"] / 4  # it trained


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.kernel
def test_two_torchrun_nodes_run_an_exported_cell_and_follow_shows_them(tmp_path, no_leftovers):
    script, run_dir, elsewhere = tmp_path / "export" / "train.py", tmp_path / "runs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = _free_port()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in [
        SETUP,
        TRAIN.format(flags=f"--export {script} --run-dir {run_dir} --seed 0"),
        "%%ddp --export x.py --return final_w\npass",
        "%%ddp --run-dir somewhere --cpus 2\npass",
        f"import json, time\narrivals = []\n"
        f"run = ddp_notebook.follow({str(run_dir)!r}, timeout=100, "
        f"callbacks=[lambda record: arrivals.append(time.time())])\n"
        f"print('FOLLOWED', json.dumps({{'status': run.status, 'world': run.spec.world_size, "
        f"'nnodes': run.spec.nnodes, 'history': run.history, 'spread': max(arrivals) - min(arrivals)}}))",
        f"print('AGAIN', json.dumps(ddp_notebook.follow({str(run_dir)!r}, wait=False).history))",
    ]])
    client = NotebookClient(nb, km=kernel_manager(), timeout=120, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    agents = []
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]
    try:
        with client.setup_kernel():
            for index in range(4):
                client.execute_cell(nb.cells[index], index)
            # Two agents on this machine acting as two nodes: c10d rendezvous, one rank each, started elsewhere.
            rdzv = ["--nnodes", 2, "--nproc-per-node", 1, "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"127.0.0.1:{port}", "--rdzv-id", "two-nodes", script]
            agents = [_agent(rdzv, elsewhere, log) for log in logs]
            client.execute_cell(nb.cells[4], 4)  # follows the run live, until both nodes have ended
            client.execute_cell(nb.cells[5], 5)
        codes = [agent.wait(60) for agent in agents]
    finally:
        _stop(agents)
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    assert codes == [0, 0], outputs

    exported = nb.cells[1]
    assert error(exported) is None, text(exported)
    assert "exported" in text(exported) and "torchrun --nproc-per-node N" in text(exported)
    assert os.path.getsize(script.with_suffix(".arrays.bin")) >= 4096 * 64 * 4
    assert os.path.getsize(script.with_suffix(".payload.pkl")) < 200_000  # the tensors are not in it
    assert "does not run it" in text(nb.cells[2]) and "--return" in text(nb.cells[2])
    assert "--run-dir goes with --export" in text(nb.cells[3])
    assert sum("of 2 on node" in out and "finished" in out for out in outputs) == 2, outputs

    followed = _printed(nb.cells[4], "FOLLOWED")
    assert error(nb.cells[4]) is None, text(nb.cells[4])
    assert (followed["status"], followed["world"], followed["nnodes"]) == ("done", 2, 2)
    _check_training(followed["history"], 2)
    assert followed["spread"] > 0.6, followed  # records arrived while the run went on: followed live
    kinds = [(o.output_type, sorted(o.get("data", {}))) for o in nb.cells[4].outputs]
    # The live dashboard (plain outputs updated in place): its status, then its figure; no widget.
    assert kinds.index(("display_data", ["text/plain"])) < kinds.index(("display_data", ["image/png", "text/plain"]))
    assert not any(WIDGET_VIEW in data for _, data in kinds), kinds
    assert _printed(nb.cells[5], "AGAIN") == followed["history"]  # after the end, from the files alone

    # One file per node, written by that node alone; every line names its run, node and (for events) rank.
    files = sorted(os.listdir(run_dir))
    assert files == ["metrics-node0.jsonl", "metrics-node1.jsonl"]
    for node, name in enumerate(files):
        lines = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        assert lines[0]["event"] == "start" and lines[-1] == {**lines[-1], "event": "end", "ok": True}
        assert {line["node"] for line in lines} == {node} and len({line["run"] for line in lines}) == 1
        assert {line["rank"] for line in lines if line["event"] == "metric"} == {node}
    assert _running(str(script)) == []


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.kernel
def test_notebook_as_node_0_with_a_torchrun_node_1(tmp_path, no_leftovers):
    script, elsewhere = tmp_path / "export" / "job.py", tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = _free_port()
    refused = []

    def intrude():
        """A process without the job's key, at the channel named in the export, while the job runs."""
        payload = script.with_suffix(".payload.pkl")
        deadline = time.time() + 100
        while not payload.exists() and time.time() < deadline:
            time.sleep(0.05)
        with open(payload, "rb") as f:
            address = tuple(pickle.load(f)["notebook"]["address"])
        try:
            channel.connect(address, b"not the job's key" * 2)
        except AuthenticationError as exc:
            refused.append(repr(exc))

    node1, log = _node_1(port, script, elsewhere, tmp_path / "node1.log")
    intruder = threading.Thread(target=intrude, daemon=True)
    intruder.start()
    try:
        flags = f"--nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --port {port} --cpus 1 --export {script} " \
                f"--seed 0 --return final_w"
        nb, _ = run_cells([
            SETUP, TRAIN.format(flags=flags),
            "import json\njob = ddp_notebook.last_job()\n"
            "print('JOB', json.dumps({'history': job.history, 'status': job.status, 'world': job.spec.world_size, "
            "'w': final_w.flatten().tolist()[:3]}))",
        ], timeout=120, cwd=str(tmp_path))
        code = node1.wait(60)
    finally:
        _stop([node1])
    intruder.join(5)
    log.seek(0)
    node1_output = log.read()
    log.close()

    train = nb.cells[1]
    assert error(train) is None, text(train)
    assert code == 0, node1_output
    out = text(train)
    assert "this host is node 0 of 2" in out and f"--node-rank I --nproc-per-node 1 --master-addr 127.0.0.1 " \
                                                f"--master-port {port} {script}" in out
    assert "[rank 0] rank 0 of 2 on node 0 finished" in out  # node 0's output, relayed with its rank
    assert "rank 1 of 2 on node 1 finished" in node1_output  # node 1's stays on its host
    job = _printed(nb.cells[2], "JOB")
    assert (job["status"], job["world"]) == ("done", 2)
    _check_training(job["history"], 2)
    assert len(job["w"]) == 3  # --return copied rank 0's weights into the notebook
    kinds = [(o.output_type, sorted(o.get("data", {}))) for o in train.outputs]
    assert kinds.index(("display_data", ["text/plain"])) < kinds.index(("display_data", ["image/png", "text/plain"]))
    assert not any(WIDGET_VIEW in data for _, data in kinds), kinds
    assert refused, "a connection without the job's key was not refused"
    assert _running(str(script)) == []


@pytest.mark.timeout(90)
@pytest.mark.slow
def test_a_failure_on_another_node_stops_the_job_and_leaves_nothing(tmp_path, no_leftovers, capfd):
    script = tmp_path / "job.py"
    port = _free_port()
    node1, log = _node_1(port, script, tmp_path, tmp_path / "node1.log")
    started = time.time()
    try:
        with pytest.raises(RankError) as caught:
            ddp_notebook.launch(fails_on_node_1, cpus=1, nnodes=2, master_addr="127.0.0.1", port=port,
                                export=str(script))
        took = time.time() - started
        code = node1.wait(30)
    finally:
        _stop([node1])
    log.close()
    err = caught.value
    assert err.rank == 1 and "ValueError: node one is broken" in str(err)
    assert 'raise ValueError("node one is broken")' in err.failure.traceback  # its own traceback, from node 1
    assert took < 30
    assert code != 0  # node 1's agent saw its rank fail
    assert _running(str(script)) == []
    assert "SignalException" not in capfd.readouterr().err  # the agent's words about being stopped are not shown


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_an_export_runs_alone_from_any_directory_with_its_arrays_mapped(tmp_path):
    import numpy as np
    import torch

    table = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB
    grid = np.arange(1 << 19, dtype=np.float64).reshape(512, 1024)  # 4 MiB
    exported = ddp_notebook.export(with_arrays, tmp_path / "out" / "with_arrays.py", (table, grid))
    assert exported.arrays and os.path.getsize(exported.arrays) >= 8 << 20
    assert os.path.getsize(exported.payload) < 100_000
    assert "torchrun --nproc-per-node N" in repr(exported)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, exported.script], cwd=elsewhere, capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics-node0.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines] == ["start", "ready", "metric", "exit", "end"]
    metric = lines[2]
    assert metric["rank"] == 0 and metric["key"] == "step" and metric["x"] == 1
    assert metric["values"] == {"total": float(table.sum()), "corner": float(grid[-1, -1]), "cwd_is_elsewhere": 1.0,
                                "mapped": 1.0, "world": 1}
    assert lines[-1]["ok"] is True


@pytest.mark.timeout(150)
def test_a_followed_run_that_hangs_is_explained_from_what_its_ranks_wrote(tmp_path, capsys):
    """No one can ask the ranks of an export that reports through its files: a rank whose collectives stood still
    writes where it is, and follow() says why the run is stuck from that."""
    import re

    exported = ddp_notebook.export(one_asleep_before_all_reduce, tmp_path / "out" / "asleep.py")
    env = dict(os.environ, **{protocol.STILL_AFTER_ENV: "0.5"})
    with open(tmp_path / "agent.log", "w") as log:
        agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                  "--master-port", str(_free_port()), exported.script], cwd=tmp_path, stdout=log,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        told = ""
        while "rank 1 has not reached it" not in told and time.monotonic() < deadline:
            run = following.follow(str(tmp_path / "out"), timeout=8, hang_after=2)
            told += capsys.readouterr().err
        assert re.search(r"the run made no progress for 2 s \(hang_after\); it goes on\. Why:\n"
                         r"rank 0 waits in all_reduce #\d+ since 0:00:\d\d\n"
                         r"rank 1 has not reached it \(its last was #\d+\): it is at one_asleep_before_all_reduce "
                         r"\(torchrun_tasks.py:\d+\), `time.sleep\(90\)  # ASLEEP`", told), \
            told + (tmp_path / "agent.log").read_text()
        again = run.why()  # on demand: the same, from the files
        assert again.missing == [1] and list(again.waiting) == [0] and again.waiting[0]["name"] == "all_reduce"
        lines = [json.loads(line) for line in (tmp_path / "out" / "metrics-node0.jsonl").read_text().splitlines()]
        here = [line for line in lines if line["event"] == protocol.HERE]
        assert {line["rank"] for line in here} == {0, 1}
        assert len(here) <= 4, here  # written when where a rank is changes, not every half second
    finally:
        _stop([agent])


@pytest.mark.timeout(150)
@pytest.mark.slow
def test_a_hang_across_hosts_is_explained_by_asking_each_rank_over_the_channel(tmp_path, no_leftovers, capfd):
    """The ranks of a job on several hosts share no folder with the notebook: why() and stacks() ask them over
    the channel, node 1's rank too."""
    import re

    script = tmp_path / "job.py"
    port = _free_port()
    node1, log = _node_1(port, script, tmp_path, tmp_path / "node1.log")
    try:
        job = ddp_notebook.launch(one_asleep_before_all_reduce, cpus=1, nnodes=2, master_addr="127.0.0.1", port=port,
                                  export=str(script), background=True, hang_after=3)
        told, deadline = "", time.monotonic() + 90
        while "rank 1 has not reached it" not in told and time.monotonic() < deadline and not job.done:
            time.sleep(0.2)
            told += capfd.readouterr().err
        assert re.search(r"made no progress for 3 s \(--hang-after\); it goes on\. Why:\n"
                         r"rank 0 waits in all_reduce #\d+ since 0:00:\d\d\n"
                         r"rank 1 has not reached it \(its last was #\d+\): it is at one_asleep_before_all_reduce "
                         r"\(torchrun_tasks.py:\d+\), `time.sleep\(90\)  # ASLEEP`", told), told
        found = job.why()  # on demand, from another thread than the job's
        assert found.missing == [1] and list(found.waiting) == [0], found
        where = job.stacks()
        assert "one_asleep_before_all_reduce (torchrun_tasks.py:" in where.where(1), where
        assert where.where(0).startswith("all_reduce"), where
        job.stop(timeout=30)
        assert job.status == "stopped"
    finally:
        _stop([node1])
        log.close()
    assert _running(str(script)) == []


@pytest.mark.timeout(60)
def test_an_nccl_export_on_a_host_without_cuda_says_so(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: an nccl export runs here")
    exported = ddp_notebook.export(nothing, tmp_path / "job.py", backend="nccl")
    done = subprocess.run([sys.executable, exported.script], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert done.returncode == 1, done.stderr
    assert "rank 0 failed: RuntimeError: this job was exported for GPUs (backend nccl) but this host has no CUDA " \
           "device (torch.cuda.is_available() is False): run it on a GPU host, or export it for CPUs" in done.stderr
    assert "init_process_group" not in done.stderr  # refused before torch tried (and failed unclearly)


@pytest.mark.timeout(60)
def test_a_version_mismatch_is_told_clearly(tmp_path):
    exported = ddp_notebook.export(nothing, tmp_path / "job.py")
    with open(exported.manifest) as f:
        manifest = json.load(f)
    here = dict(manifest["versions"])
    manifest["versions"].update(torch="1.13.1", cloudpickle="2.0.0")
    with open(exported.manifest, "w") as f:
        json.dump(manifest, f)
    done = subprocess.run([sys.executable, exported.script], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"torch         1.13.1 in the notebook, {here['torch']} here" in done.stderr
    assert f"cloudpickle   2.0.0 in the notebook, {here['cloudpickle']} here" in done.stderr
    assert len([line for line in done.stderr.splitlines() if " in the notebook, " in line]) == 2  # what differs
    assert "pip install torch==1.13.1 cloudpickle==2.0.0" in done.stderr
    # A Python where ddp_notebook is not importable at all: said so, with what the export needs.
    bare = subprocess.run([sys.executable, "-S", exported.script], cwd=ROOT, capture_output=True, text=True,
                          timeout=30, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert bare.returncode == 1 and "cannot import ddp_notebook" in bare.stderr and "torch 1.13.1" in bare.stderr


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_one_writer_per_node_takes_every_local_rank_and_its_failure(tmp_path):
    exported = ddp_notebook.export(reports_then_rank_1_fails, tmp_path / "job.py")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           exported.script], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert done.returncode != 0
    assert "[ddp_notebook] rank 1 failed: ValueError: rank one is broken" in done.stdout + done.stderr
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("metrics")) == \
        ["metrics-node0.jsonl"]  # the node's two ranks, one file
    lines = [json.loads(line) for line in (tmp_path / "metrics-node0.jsonl").read_text().splitlines()]
    assert [line["event"] for line in lines].count("start") == 1
    assert sorted((line["rank"], line["values"]["local"]) for line in lines if line["event"] == "metric") == \
        [(0, 0), (1, 1)]
    failed = [line for line in lines if line["event"] == "failed"]
    assert [(f["rank"], f["etype"], f["message"]) for f in failed] == [(1, "ValueError", "rank one is broken")]
    run = ddp_notebook.follow(str(tmp_path), wait=False)
    assert run.status == "failed" and run.error.rank == 1
    assert run.history == [{"epoch": 1, "loss": 0.5, "local": 0.5}]


def _write_lines(path, records, partial_last=False):
    data = "".join(json.dumps(r) + "\n" for r in records)
    with open(path, "a") as f:
        f.write(data[:-10] if partial_last else data)


@pytest.mark.timeout(60)
def test_follow_tails_the_files_until_every_node_has_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(following, "QUIET_AFTER_FAILURE_S", 0.5)
    old = {"run": "old", "node": 0, "time": 1.0}
    _write_lines(tmp_path / "metrics-node0.jsonl", [{**old, "event": "start", "world_size": 1, "nnodes": 1},
                                                    {**old, "event": "end", "ok": True}])
    t0 = time.time()
    heads = [{"run": "new", "node": n, "time": t0} for n in (0, 1)]

    def node(n, epoch):
        return {**heads[n], "event": "metric", "rank": n, "key": "epoch", "x": epoch, "values": {"loss": n + epoch}}

    def write():
        for n in (0, 1):
            path = protocol.metrics_path(str(tmp_path), n)
            tmp = path + ".new"  # a new run's file replaces the old one
            _write_lines(tmp, [{**heads[n], "event": "start", "world_size": 2, "nnodes": 2},
                               {**heads[n], "event": "ready", "rank": n}])
            os.replace(tmp, path)
        for epoch in (1, 2, 3):
            time.sleep(0.3)
            _write_lines(protocol.metrics_path(str(tmp_path), 0), [node(0, epoch)])
            _write_lines(protocol.metrics_path(str(tmp_path), 1), [node(1, epoch)], partial_last=epoch == 3)
        time.sleep(0.3)
        with open(protocol.metrics_path(str(tmp_path), 1), "a") as f:  # the rest of the half-written line
            f.write(json.dumps(node(1, 3))[-9:] + "\n")
        for n in (0, 1):
            time.sleep(0.3)
            _write_lines(protocol.metrics_path(str(tmp_path), n), [{**heads[n], "event": "exit", "rank": n},
                                                                {**heads[n], "event": "end", "ok": True}])

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.05)
    run = ddp_notebook.follow(str(tmp_path), timeout=20)
    ended = time.time()
    writer.join()
    assert run.status == "done" and run.run_id == "new" and run.spec.world_size == 2
    assert [(r["epoch"], r["loss"]) for r in run.history] == [(1, 1.5), (2, 2.5), (3, 3.5)]
    assert ended - t0 >= 1.5  # it waited for both nodes' ends

    # A failed run: one node reports the failure and never writes its end; follow ends once the files are quiet.
    failed = tmp_path / "failed"
    failed.mkdir()
    head = {"run": "f", "node": 0, "time": time.time()}
    _write_lines(protocol.metrics_path(str(failed), 0), [
        {**head, "event": "start", "world_size": 2, "nnodes": 1},
        {**head, "event": "failed", "rank": 1, "etype": "ValueError", "message": "bad", "traceback": "tb",
         "kind": "user"},
        {**head, "event": "failed", "rank": 0, "etype": "DistBackendError", "message": "peer gone",
         "traceback": "", "kind": "comm"}])
    run = ddp_notebook.follow(str(failed), timeout=20)
    assert run.status == "failed" and run.error.rank == 1 and "ValueError: bad" in str(run.error)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_stopping_a_node_0_job_ends_every_node(tmp_path, no_leftovers):
    script = tmp_path / "job.py"
    port = _free_port()
    node1, log = _node_1(port, script, tmp_path, tmp_path / "node1.log")
    try:
        job = ddp_notebook.launch(sleeps, cpus=1, nnodes=2, master_addr="127.0.0.1", port=port, export=str(script),
                                  background=True)
        deadline = time.time() + 40
        while len(job.group.ready) < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert job.group.ready == {0, 1}  # both nodes' ranks joined the notebook's channel
        job.stop()
        assert job.status == "stopped"
        code = node1.wait(20)  # its rank saw the channel close and stopped; its agent followed
    finally:
        _stop([node1])
    log.close()
    assert code != 0
    assert _running(str(script)) == []


KILLED_NOTEBOOK = """\
import sys
sys.path.insert(0, {tests!r})
import ddp_notebook
from torchrun_tasks import sleeps
ddp_notebook.launch(sleeps, cpus=1, nnodes=2, master_addr="127.0.0.1", port={port}, export={script!r})
"""


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_killed_notebook_leaves_nothing_on_any_node(tmp_path):
    from conftest import job_dirs

    script = tmp_path / "job.py"
    port = _free_port()
    before = job_dirs()
    node1, log = _node_1(port, script, tmp_path, tmp_path / "node1.log")
    code = KILLED_NOTEBOOK.format(tests=os.path.dirname(os.path.abspath(__file__)), port=port, script=str(script))
    notebook = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    try:
        for line in notebook.stdout:
            if "[rank 0] PID" in line:
                break
        time.sleep(0.5)
        assert len([p for p in _running(str(script)) if p.pid != notebook.pid]) == 4  # both agents, both ranks
        assert job_dirs() - before
        notebook.kill()
        notebook.wait()
        assert node1.wait(20) != 0
        deadline = time.time() + 10
        while (_running(str(script)) or job_dirs() - before) and time.time() < deadline:
            time.sleep(0.1)
    finally:
        _stop([node1])
        if notebook.poll() is None:
            notebook.kill()
        notebook.stdout.close()
    log.close()
    assert _running(str(script)) == []
    assert job_dirs() - before == set()


def test_node_jobs_refuse_what_cannot_work(tmp_path):
    from ddp_notebook import LaunchError
    from ddp_notebook.engine import spec as job_spec
    from ddp_notebook.engine import multinode
    from ddp_notebook.wire import protocol

    def spec():
        return job_spec.JobSpec(world_size=2)

    with pytest.raises(LaunchError, match="needs --master-addr"):
        multinode.node_spec(spec(), 2, 0, None, None)
    with pytest.raises(LaunchError, match="runs node 0"):
        multinode.node_spec(spec(), 2, 1, "127.0.0.1", None)
    with pytest.raises(LaunchError, match="2 or more"):
        multinode.node_spec(spec(), 0, 0, "127.0.0.1", None)
    with pytest.raises(LaunchError, match="not an address of this host"):
        multinode.node_spec(spec(), 2, 0, "192.0.2.1", None)  # TEST-NET-1: never this host's
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        taken = spec()
        taken.port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match="already in use"):
            multinode.node_spec(taken, 2, 0, "127.0.0.1", None)
    made = multinode.node_spec(spec(), 3, 0, "127.0.0.1", str(tmp_path / "job.py"))
    assert (made.world_size, made.nnodes, made.export_path) == (6, 3, str(tmp_path / "job.py"))
    assert made.port and f"--master-port {made.port}" in made.notes[-1] and "I = 1..2" in made.notes[-1]
