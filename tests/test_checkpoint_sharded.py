"""Checkpoints of sharded models (FSDP2 ``fully_shard``) on real gloo ranks: every element of a checkpoint read with no
process group equals the ranks' full tensors; resume on another world size; DDP <-> FSDP2; a rank killed while
saving; a save some ranks do not make."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddp_notebook
from ddp_notebook.rank import checkpoint
from checkpoint_pause import pause_before_rename

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Generated(torch.nn.Module):
    """A chain of linear layers built from a spec: each layer optionally with a buffer, a pair of them sharing one
    weight (tied), some layers sharded on their own (nested ``fully_shard``), the root sharded or left plain."""

    def __init__(self, spec):
        super().__init__()
        dims, dtype = spec["dims"], DTYPES[spec["dtype"]]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, dtype=dtype) for a, b in zip(dims, dims[1:]))
        for i in spec["buffers"]:
            self.layers[i].register_buffer("stat", torch.randn(dims[i + 1]).to(dtype))
        if spec["tied"]:
            width = dims[-1]
            self.tied_a = torch.nn.Linear(width, width, dtype=dtype)
            self.tied_b = torch.nn.Linear(width, width, bias=False, dtype=dtype)
            self.tied_b.weight = self.tied_a.weight

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if hasattr(self, "tied_a"):
            x = self.tied_b(self.tied_a(x))
        return x


@st.composite
def model_specs(draw):
    dims = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))  # 1 and 2: dim 0 smaller than 3 ranks
    layers = len(dims) - 1
    shard_layers = draw(st.lists(st.sampled_from(range(layers)), unique=True, max_size=layers))
    root = draw(st.booleans())
    if not root and not shard_layers:
        shard_layers = [0]  # partly sharded at least
    return {"dims": dims, "dtype": draw(st.sampled_from(sorted(DTYPES))), "shard_layers": sorted(shard_layers),
            "shard_root": root, "buffers": draw(st.lists(st.sampled_from(range(layers)), unique=True)),
            "tied": draw(st.booleans()) and root}  # tied weights stay in one FSDP group: the root's


def _build(spec, seed, shard):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Generated(spec)
    if shard:
        for i in spec["shard_layers"]:
            fully_shard(model.layers[i])
        if spec["shard_root"]:
            fully_shard(model)
    return model


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _full_state(model, optimizer):
    """Every tensor of the model and of the optimizer's state, whole (DTensor.full_tensor()), by name."""
    weights = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
    state = {name: {k: _full(v).clone() if isinstance(v, torch.Tensor) else v
                    for k, v in optimizer.state[p].items()}
             for name, p in model.named_parameters()}
    return weights, state


def _step(model, optimizer, spec, seed):
    x = torch.randn(5, spec["dims"][0], generator=torch.Generator().manual_seed(seed)).to(DTYPES[spec["dtype"]])
    optimizer.zero_grad()
    model(x).float().square().mean().backward()
    optimizer.step()


def _save_generated(specs, workdir):
    """Each spec: shard, one AdamW step, save; the full tensors the ranks hold afterwards."""
    out = []
    for i, spec in enumerate(specs):
        model = _build(spec, seed=i, shard=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        _step(model, optimizer, spec, seed=i)
        ddp_notebook.save_checkpoint(os.path.join(workdir, f"model{i}"), model, optimizer, epoch=i, index=i)
        out.append(_full_state(model, optimizer))
    return out


def _assert_same(got, expected, what):
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{what}: {key}"


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(specs=st.lists(model_specs(), min_size=2, max_size=3), world_size=st.sampled_from([2, 3]))
def test_every_element_of_a_sharded_checkpoint_loads_whole_with_no_process_group(specs, world_size,
                                                                                 tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("generated"))
    ranks = ddp_notebook.launch(_save_generated, (specs, workdir), cpus=world_size)
    for i, spec in enumerate(specs):
        weights, optimizer_state = ranks[0][i]
        for other in ranks[1:]:  # every rank gathers the same whole tensors
            _assert_same(other[i][0], weights, f"rank's weights, model {i}")
        path = os.path.join(workdir, f"model{i}")
        model = _build(spec, seed=100 + i, shard=False)  # other values, replaced by the load
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        info = ddp_notebook.load_checkpoint(path, model, optimizer)
        assert (info.epoch, info.extra, info.world_size, info.sharded) == (i, {"index": i}, world_size, True)
        _assert_same(model.state_dict(), weights, f"loaded model {i} ({spec})")
        for name, p in model.named_parameters():
            _assert_same(optimizer.state[p], optimizer_state[name], f"optimizer state of {name}, model {i}")
        whole = ddp_notebook.load_checkpoint(path)
        _assert_same(whole.model_state, weights, f"state dict of model {i}")
        assert torch.equal(whole.optimizer_state["state"]["layers.0.weight"]["exp_avg"],
                           optimizer_state["layers.0.weight"]["exp_avg"])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 17)  # 17 rows: uneven shards on 2 and 3 ranks
        self.drop = torch.nn.Dropout(0.2)
        self.b = torch.nn.Linear(17, 3)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def _fsdp_net(seed):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    fully_shard(model.a)
    fully_shard(model)
    return model


def _dataset():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(120, 6, generator=generator)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(120))


def _epoch(model, optimizer, loader):
    order = []
    for x, y, idx in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        order += idx.tolist()
    return order


def _save_or_resume(path, save):
    """Save an FSDP2 model after one epoch; or resume it (on another world size) and report what came back."""
    model = _fsdp_net(seed=1 if save else 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = ddp_notebook.distributed_loader(_dataset(), batch_size=8)
    if save:
        _epoch(model, optimizer, loader)
        ddp_notebook.save_checkpoint(path, model, optimizer, 0, loader=loader)
        return _full_state(model, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ddp_notebook.resume(path, model, optimizer, loader)
    resumed = _full_state(model, optimizer)
    return {"start": int(start), "sampler_epoch": loader.next_epoch, "state": resumed,
            "missing": start.checkpoint.rng_missing_ranks,
            "warnings": [str(w.message) for w in caught if w.category is checkpoint.ResumeWarning]}


@pytest.mark.parametrize("saved_on,resumed_on", [(3, 2), (2, 3)])
def test_resuming_a_sharded_checkpoint_on_another_world_size_reshards_weights_and_optimizer(
        tmp_path, saved_on, resumed_on, no_leftovers):
    path = str(tmp_path / "fsdp")
    saved = ddp_notebook.launch(_save_or_resume, (path, True), cpus=saved_on)
    seen = ddp_notebook.launch(_save_or_resume, (path, False), cpus=resumed_on)
    weights, optimizer_state = saved[0]
    for rank, got in enumerate(seen):
        assert (got["start"], got["sampler_epoch"]) == (1, 1)  # the data order continues at the next epoch
        _assert_same(got["state"][0], weights, f"rank {rank}'s weights")
        for name, state in optimizer_state.items():
            _assert_same(got["state"][1][name], state, f"rank {rank}'s optimizer state of {name}")
        assert got["missing"] == list(range(saved_on, resumed_on))
    message, = seen[0]["warnings"]
    assert message.startswith(f"{path} was saved by {saved_on} ranks and is resumed on {resumed_on}: ")
    if resumed_on > saved_on:
        assert message.endswith("Rank 2 had no saved RNG state: it keeps its current random state.")
    assert all(got["warnings"] == [] for got in seen[1:])


def _ddp_and_back(workdir):
    """DDP checkpoint -> FSDP2 model -> FSDP2 checkpoint -> DDP model; a rank-0-only save refused; best-k kept."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    loader = ddp_notebook.distributed_loader(_dataset(), batch_size=8)
    torch.manual_seed(1)
    ddp = DDP(Net())
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=0.05)
    _epoch(ddp, ddp_opt, loader)
    ddp_file = os.path.join(workdir, "ddp.pt")
    ddp_notebook.save_checkpoint(ddp_file, ddp, ddp_opt, 0)
    dist.barrier()
    out = {"ddp": _full_state(ddp.module, ddp_opt)}

    fsdp = _fsdp_net(seed=5)
    fsdp_opt = torch.optim.AdamW(fsdp.parameters(), lr=0.05)
    ddp_notebook.load_checkpoint(ddp_file, fsdp, fsdp_opt)
    out["fsdp_from_ddp"] = _full_state(fsdp, fsdp_opt)
    _epoch(fsdp, fsdp_opt, loader)
    fsdp_dir = os.path.join(workdir, "fsdp")
    ddp_notebook.save_checkpoint(fsdp_dir, fsdp, fsdp_opt, 1)
    out["fsdp"] = _full_state(fsdp, fsdp_opt)

    torch.manual_seed(6)
    back = DDP(Net())
    back_opt = torch.optim.AdamW(back.parameters(), lr=0.05)
    ddp_notebook.load_checkpoint(fsdp_dir, back, back_opt)
    out["ddp_from_fsdp"] = _full_state(back.module, back_opt)

    before = sorted(os.listdir(workdir))
    if rank == 0:
        with pytest.raises(RuntimeError) as refused:
            ddp_notebook.save_checkpoint(os.path.join(workdir, "alone"), fsdp, fsdp_opt, 2)
        out["refused"] = str(refused.value)
        with pytest.raises(RuntimeError) as refused_load:
            ddp_notebook.load_checkpoint(fsdp_dir, fsdp, fsdp_opt)
        out["refused_load"] = str(refused_load.value)
    dist.barrier()
    out["written_meanwhile"] = sorted(set(os.listdir(workdir)) - set(before))
    ddp_notebook.save_checkpoint(os.path.join(workdir, "alone"), fsdp, fsdp_opt, 2)  # every rank: it works
    with pytest.raises(FileExistsError) as on_a_file:
        ddp_notebook.save_checkpoint(ddp_file, fsdp, fsdp_opt, 3)
    out["on_a_file"] = str(on_a_file.value)

    best = ddp_notebook.BestCheckpoint(os.path.join(workdir, "best"), monitor="acc", keep=2)
    out["best_saved"] = [best.update(fsdp, score, fsdp_opt, epoch=e) for e, score in enumerate([0.5, 0.7, 0.6, 0.1])]
    dist.barrier()
    out["best_files"] = sorted(n for n in os.listdir(workdir) if n.startswith("best"))
    return out


def test_ddp_checkpoints_load_into_fsdp2_and_back_and_a_rank0_only_save_is_refused(tmp_path, monkeypatch,
                                                                                  no_leftovers):
    monkeypatch.setenv(checkpoint.ARRIVAL_TIMEOUT_ENV, "3")
    ranks = ddp_notebook.launch(_ddp_and_back, (str(tmp_path),), cpus=2)
    for rank, out in enumerate(ranks):
        for loaded, source in (("fsdp_from_ddp", "ddp"), ("ddp_from_fsdp", "fsdp")):
            _assert_same(out[loaded][0], ranks[0][source][0], f"rank {rank}: {loaded} weights")
            for name, state in ranks[0][source][1].items():
                _assert_same(out[loaded][1][name], state, f"rank {rank}: {loaded} optimizer state of {name}")
        assert out["written_meanwhile"] == []
        assert out["on_a_file"].startswith(f"{tmp_path / 'ddp.pt'} is a single-file checkpoint")
        assert out["best_saved"] == [True, True, True, False]
        assert out["best_files"] == ["best-epoch1", "best-epoch2"]
    assert not torch.equal(ranks[0]["fsdp"][0]["a.weight"], ranks[0]["ddp"][0]["a.weight"])  # it trained on
    alone = str(tmp_path / "alone")
    assert ranks[0]["refused"] == (
        f"save_checkpoint({alone!r}) of a sharded model is done by every rank at once, and rank 1 did not call it "
        f"within 3 s of rank 0: call it on every rank, not under `if rank == 0:` (a rank may lag "
        f"DDP_NOTEBOOK_CHECKPOINT_ARRIVAL_S seconds). Refused before anything was written or read.")
    assert ranks[0]["refused_load"].startswith(f"load_checkpoint({str(tmp_path / 'fsdp')!r}) of a sharded model "
                                               f"is done by every rank at once, and rank 1 did not call it")
    assert ddp_notebook.load_checkpoint(alone).epoch == 2
    for kept in ("best-epoch1", "best-epoch2"):  # the index and the one save it names, nothing else
        index = json.loads((tmp_path / kept / checkpoint.SHARDED_INDEX).read_text())
        assert sorted(os.listdir(tmp_path / kept)) == [checkpoint.SHARDED_INDEX, index["current"]]


def test_a_directory_without_a_finished_save_is_no_checkpoint(tmp_path):
    (tmp_path / "ck").mkdir()
    assert ddp_notebook.resume(tmp_path / "ck", Net()) == 0
    with pytest.raises(FileNotFoundError, match="is a directory with no complete checkpoint in it"):
        ddp_notebook.load_checkpoint(tmp_path / "ck", Net())
    with pytest.raises(IsADirectoryError, match="a model that is not sharded is saved as one file"):
        ddp_notebook.save_checkpoint(tmp_path / "ck", Net())
    assert os.listdir(tmp_path / "ck") == []


KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch, ddp_notebook
    sys.path.insert(0, sys.argv[3])
    from test_checkpoint_sharded import _saves_then_pauses
    try:
        ddp_notebook.launch(_saves_then_pauses, (sys.argv[1], sys.argv[2]), cpus=2)
    except ddp_notebook.RankError as exc:
        print("launch failed:", str(exc).splitlines()[0], flush=True)
""")


def _saves_then_pauses(path, signal_file):
    """Save weights of 1, then weights of 2 with rank 0 paused (for the test to kill it) after every rank has
    written its shards, before the new save is made current."""
    model = _fsdp_net(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    pause_before_rename(path, signal_file)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    ddp_notebook.save_checkpoint(path, model, epoch=2)


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, no_leftovers):
    path, signal_file = tmp_path / "fsdp", tmp_path / "paused.json"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), str(signal_file),
                             os.path.dirname(__file__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not signal_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert signal_file.exists(), proc.communicate()
        paused = json.loads(signal_file.read_text())
        os.kill(paused["pid"], signal.SIGKILL)  # rank 0, between the last shard written and the commit
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "launch failed: rank 0 failed: RankDied: rank 0 was killed by SIGKILL" in out, (out, err)
    new_save = paused["temp"]
    assert os.path.isfile(os.path.join(new_save, ".metadata"))  # every shard of the new save was written ...
    model = Net()
    info = ddp_notebook.load_checkpoint(path, model)  # ... and yet the checkpoint is the previous one, whole
    assert info.epoch == 1
    assert all(torch.equal(p, torch.ones_like(p)) for p in model.parameters())

    ddp_notebook.launch(_save_or_resume, (str(path), True), cpus=2)  # the next save removes the unfinished one
    assert not os.path.exists(new_save)
    assert len([n for n in os.listdir(path) if n.startswith(checkpoint.SAVE_FOLDER_PREFIX)]) == 1
    assert ddp_notebook.load_checkpoint(path).epoch == 0
