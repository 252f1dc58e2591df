"""Sharded models in exported runs: an FSDP2 task exported for torchrun trains on 2 CPU ranks under a real agent,
returns its model whole (in a scheduler's result file, or to the notebook that runs node 0) and checkpoints it as a
notebook's ranks do."""
import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

import ddp_notebook
from ddp_notebook.engine import export
from ddp_notebook.wire import payload, protocol

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 33)  # 33 rows: uneven shards on 2 ranks
        self.b = torch.nn.Linear(33, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def train_and_checkpoint(path: str):
    """Rank side: FSDP2 training over a distributed loader, a checkpoint every rank writes; (model, optimizer, the
    ranks' full tensors of both, by parameter name)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.a)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 5))
    loader = ddp_notebook.distributed_loader(data, batch_size=8)
    for epoch in range(2):
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        ddp_notebook.save_checkpoint(path, model, opt, epoch=epoch, loader=loader)
    names = [name for name, _ in model.named_parameters()]
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    state = {name: {key: value.full_tensor() if hasattr(value, "full_tensor") else value
                    for key, value in opt.state[p].items()} for name, p in zip(names, model.parameters())}
    return model, opt, full, state


def _assert_whole(model, opt, full, state):
    assert type(model) is Net and all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert {name: torch.equal(p, full[name]) for name, p in model.named_parameters()} == dict.fromkeys(full, True)
    params = opt.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    for (name, _), p in zip(model.named_parameters(), params):
        assert {key: torch.equal(value, state[name][key]) for key, value in opt.state[p].items()} == \
            dict.fromkeys(state[name], True), name


def _assert_checkpointed(path, full, state):
    restored = Net()
    loaded = ddp_notebook.load_checkpoint(path, restored)  # here, with no process group
    assert loaded.epoch == 1 and loaded.world_size == 2
    assert {name: torch.equal(p, full[name]) for name, p in restored.named_parameters()} == dict.fromkeys(full, True)
    whole = ddp_notebook.load_checkpoint(path)
    assert {name: torch.equal(t, full[name]) for name, t in whole.model_state.items()} == dict.fromkeys(full, True)
    saved = whole.optimizer_state["state"]
    assert {name: [torch.equal(saved[name][key], value) for key, value in state[name].items()] for name in full} == \
        {name: [True] * len(state[name]) for name in full}


def _torchrun(*args, cwd, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_exported_fsdp2_task_returns_its_model_whole_in_the_result_file_and_checkpoints_it(tmp_path):
    script, checkpoint = tmp_path / "export" / "train.py", tmp_path / "ckpt"
    task = payload.CallTask(train_and_checkpoint, (str(checkpoint),), {}, False,
                            payload.sources_for(train_and_checkpoint))
    # As a scheduler's run exports it (engine/slurm.py): each rank's return value into a file of the run directory.
    export.write(task, script, rank_options={"results_to_files": True})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = _torchrun("--standalone", "--nproc-per-node", 2, script, cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr

    records = [json.loads(line) for line in (script.parent / "metrics-node0.jsonl").read_text().splitlines()]
    results = {r["rank"]: r["file"] for r in records if r["event"] == protocol.FILE_RESULT}
    assert results == {0: protocol.result_name(0), 1: protocol.result_name(1)}
    assert records[-1]["event"] == protocol.FILE_END and records[-1]["ok"] is True
    values = []
    for rank in (0, 1):
        with open(script.parent / results[rank], "rb") as f:
            values.append(pickle.load(f))
    (model, opt, full, state), other = payload.joined_results(values)  # as a Slurm job's notebook joins them
    _assert_whole(model, opt, full, state)
    assert other[0] is model and other[1] is opt  # rank 1's refers to rank 0's whole objects
    _assert_checkpointed(checkpoint, full, state)


def test_the_notebook_as_node_0_gets_the_fsdp2_model_whole_from_a_torchrun_node(tmp_path, no_leftovers):
    script, checkpoint, elsewhere = tmp_path / "export" / "job.py", tmp_path / "ckpt", tmp_path / "elsewhere"
    elsewhere.mkdir()
    port = _free_port()
    log = open(tmp_path / "node1.log", "w+")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    node1 = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", "1",
                              "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                              str(script)], cwd=elsewhere, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True, env=env)
    try:
        results = ddp_notebook.launch(train_and_checkpoint, args=(str(checkpoint),), cpus=1, nnodes=2,
                                      master_addr="127.0.0.1", port=port, export=str(script))
        code = node1.wait(60)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)
        log.seek(0)
        node1_output = log.read()
        log.close()
    assert code == 0, node1_output
    model, opt, full, state = results[0]
    _assert_whole(model, opt, full, state)
    _assert_checkpointed(checkpoint, full, state)
