"""Checkpoints: resume on real gloo ranks, any wrapping, atomic writes under SIGKILL or a full disk, best-k
bookkeeping."""
import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import ddp_notebook
from ddp_notebook.rank import checkpoint

pytestmark = pytest.mark.timeout(150)

EPOCHS = 4
SAVED_AFTER_EPOCH = 1


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3))
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def _train_set():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(1001, 6, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return torch.utils.data.TensorDataset(x, y, torch.arange(1001))


def _plain_weights(model):
    return {k: v.detach().cpu().clone() for k, v in ddp_notebook.unwrap_model(model).state_dict().items()}


def _train(workdir, dataset, resume):
    """Train EPOCHS epochs (or resume after SAVED_AFTER_EPOCH); returns each epoch's data order and the weights."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(100)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ddp_notebook.distributed_loader(dataset, batch_size=40)
    mid = os.path.join(workdir, "mid.pt")
    out = {"orders": {}}
    start = 0
    if resume:
        torch.manual_seed(999)  # the resumed process starts from other random state
        resumed = ddp_notebook.load_checkpoint(mid, model, optimizer, loader=loader)
        start = resumed.next_epoch
        out["resumed"] = {"epoch": resumed.epoch, "sampler_epoch": resumed.sampler_epoch,
                          "missing": resumed.rng_missing_ranks, "extra": resumed.extra,
                          "has_rng": resumed.rng_state is not None}
    for epoch in range(start, EPOCHS):
        model.train()
        order = []
        for x, y, idx in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            order += idx.tolist()
        out["orders"][epoch] = order
        if epoch == SAVED_AFTER_EPOCH and not resume:
            ddp_notebook.save_checkpoint(mid, model, optimizer, epoch, loader=loader, note="mid-run")
            if rank == 0:  # no collective inside: cannot hang under `if rank == 0`
                ddp_notebook.save_checkpoint(os.path.join(workdir, "rank0_only.pt"), model, optimizer, epoch)
    out["weights"] = _plain_weights(model)
    if resume:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            only0 = ddp_notebook.load_checkpoint(os.path.join(workdir, "rank0_only.pt"), Net(), restore_rng=True)
        out["rank0_only"] = {"missing": only0.rng_missing_ranks,
                             "warnings": [str(w.message) for w in caught if w.category is checkpoint.ResumeWarning]}
    else:
        out["round_trips"] = _round_trips(workdir)
    return out


def _round_trips(workdir):
    """Save from each wrapping (our way and the naive way), load into each wrapping; the mismatches."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    wrappings = {
        "plain": lambda m: m,
        "ddp": lambda m: DDP(m),
        "compiled": lambda m: torch.compile(m),  # never run: the state_dict prefixes are what matter
        "ddp(compiled)": lambda m: DDP(torch.compile(m)),
        "compiled(ddp)": lambda m: torch.compile(DDP(m)),
    }

    def fresh(seed, wrap):
        torch.manual_seed(seed)
        return wrappings[wrap](Net())

    problems, prefixes = [], {}
    for seed, source in enumerate(wrappings, start=1):
        model = fresh(seed, source)
        expected = _plain_weights(model)
        ours = os.path.join(workdir, f"ours-{seed}.pt")
        naive = os.path.join(workdir, f"naive-{seed}.pt")
        ddp_notebook.save_checkpoint(ours, model)
        if dist.get_rank() == 0:
            torch.save(model.state_dict(), naive)  # the seed recipe's way: keeps module. / _orig_mod.
        dist.barrier()  # rank 0 has written both files
        prefixes[source] = {
            "ours": sorted({k.split(".")[0] for k in torch.load(ours, weights_only=True)["model"]}),
            "naive": sorted({k.split(".")[0] for k in torch.load(naive, weights_only=True)}),
        }
        for target in wrappings:
            for kind, path in (("ours", ours), ("naive", naive)):
                loaded = fresh(50 + seed, target)
                ddp_notebook.load_checkpoint(path, loaded)
                got = _plain_weights(loaded)
                if got.keys() != expected.keys() or not all(torch.equal(got[k], expected[k]) for k in got):
                    problems.append(f"{kind} {source} -> {target}")
        dist.barrier()  # everyone has read before the next source
    return {"problems": problems, "prefixes": prefixes}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("resume"))
    dataset = _train_set()
    uninterrupted = ddp_notebook.launch(_train, (workdir, dataset, False), cpus=2, seed=1)
    resumed = ddp_notebook.launch(_train, (workdir, dataset, True), cpus=2, seed=2)
    return workdir, uninterrupted, resumed


@pytest.mark.slow
def test_a_resumed_run_repeats_the_uninterrupted_data_order_and_weights(runs):
    workdir, uninterrupted, resumed = runs
    for rank in range(2):
        full, cont = uninterrupted[rank], resumed[rank]
        assert cont["resumed"] == {"epoch": SAVED_AFTER_EPOCH, "sampler_epoch": SAVED_AFTER_EPOCH + 1, "missing": [],
                                   "extra": {"note": "mid-run"}, "has_rng": True}
        assert sorted(cont["orders"]) == list(range(SAVED_AFTER_EPOCH + 1, EPOCHS))
        for epoch in cont["orders"]:
            assert cont["orders"][epoch] == full["orders"][epoch]
        assert full["orders"][0] != full["orders"][1]
        for name, value in full["weights"].items():
            assert torch.equal(cont["weights"][name], value), name
    # The run did train, and dropout drew random numbers: weights after the resume point moved.
    mid = torch.load(os.path.join(workdir, "mid.pt"), weights_only=True)
    assert not torch.equal(mid["model"]["head.weight"], uninterrupted[0]["weights"]["head.weight"])
    assert set(os.listdir(workdir)) >= {"mid.pt", "mid.pt.rank0.rng", "mid.pt.rank1.rng"}


@pytest.mark.slow
def test_resuming_names_the_ranks_whose_rng_state_is_missing(runs):
    _, _, resumed = runs
    assert resumed[0]["rank0_only"]["missing"] == [1]
    message, = resumed[0]["rank0_only"]["warnings"]
    assert "no RNG state for rank(s) 1" in message and "rank0_only.pt.rank1.rng" in message
    assert resumed[1]["rank0_only"] == {"missing": [1], "warnings": []}  # said once, by rank 0


@pytest.mark.slow
def test_round_trips_between_plain_ddp_and_compiled_models(runs):
    _, uninterrupted, _ = runs
    for rank in range(2):
        assert uninterrupted[rank]["round_trips"]["problems"] == []
    prefixes = uninterrupted[0]["round_trips"]["prefixes"]
    for source, found in prefixes.items():
        assert found["ours"] == ["body", "head", "norm"], source  # no module. / _orig_mod. in our files
    assert prefixes["ddp"]["naive"] == ["module"]
    assert prefixes["compiled"]["naive"] == ["_orig_mod"]
    assert prefixes["compiled(ddp)"]["naive"] == ["_orig_mod"]


def test_a_naive_ddp_state_dict_loads_into_a_plain_model_with_metadata(tmp_path):
    source = Net()
    source(torch.randn(4, 6))  # BatchNorm running stats move away from their defaults
    state = {f"module.{k}": v for k, v in source.state_dict().items()}
    torch.save(state, tmp_path / "naive.pt")
    target = Net()
    info = ddp_notebook.load_checkpoint(tmp_path / "naive.pt", target)
    assert not info.toolkit_format and info.epoch is None and info.rng_missing_ranks == []
    for k, v in source.state_dict().items():
        assert torch.equal(target.state_dict()[k], v), k


def test_a_submodule_really_named_module_keeps_its_name(tmp_path):
    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    source = Holder()
    assert ddp_notebook.clean_state_dict(source.state_dict(), list(source.state_dict())).keys() == \
        source.state_dict().keys()
    torch.save({f"module.{k}": v for k, v in source.state_dict().items()}, tmp_path / "ddp_of_holder.pt")
    target = Holder()
    ddp_notebook.load_checkpoint(tmp_path / "ddp_of_holder.pt", target)
    assert torch.equal(target.module.weight, source.module.weight)


def test_values_that_weights_only_loading_rejects_are_refused_before_writing(tmp_path):
    import numpy as np

    model = Net()
    ddp_notebook.save_checkpoint(tmp_path / "ok.pt", model, epoch=np.int64(2), accuracy=np.float64(0.5),
                                 curve=np.arange(3.0))
    loaded = ddp_notebook.load_checkpoint(tmp_path / "ok.pt", Net())
    assert loaded.epoch == 2 and loaded.extra["accuracy"] == 0.5 and loaded.extra["curve"].tolist() == [0, 1, 2]

    class Custom:
        pass

    with pytest.raises(TypeError, match="'thing' \\(Custom\\)"):
        ddp_notebook.save_checkpoint(tmp_path / "bad.pt", model, thing=Custom())
    assert not (tmp_path / "bad.pt").exists()


def test_loading_weights_leaves_the_random_state_alone_and_resuming_restores_it(tmp_path):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(21)
    ddp_notebook.save_checkpoint(tmp_path / "c.pt", model, optimizer, epoch=0)
    after_save = torch.rand(3)

    target = Net()
    target_optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    ddp_notebook.load_checkpoint(tmp_path / "c.pt", target)
    assert torch.equal(torch.rand(3), expected)  # weights only: the random state is untouched

    info = ddp_notebook.load_checkpoint(tmp_path / "c.pt", target, target_optimizer)
    assert info.rng_state is not None and info.rng_missing_ranks == []
    assert torch.equal(torch.rand(3), after_save)  # the draws continue where the saved run was
    with pytest.raises(ValueError, match="saved without loader="):
        ddp_notebook.load_checkpoint(tmp_path / "c.pt", Net(), loader=ddp_notebook.distributed_loader(range(4)))


KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch, ddp_notebook
    path, signal_file = sys.argv[1], sys.argv[2]
    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, 1.0)
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    os.environ["DDP_NOTEBOOK_TEST_PAUSE_BEFORE_RENAME"] = signal_file
    torch.nn.init.constant_(model.weight, 2.0)
    ddp_notebook.save_checkpoint(path, model, epoch=2)
    print("the rename happened", flush=True)
""")


def test_sigkill_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path):
    path, signal_file = tmp_path / "model.pt", tmp_path / "paused.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), str(signal_file)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not signal_file.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert signal_file.exists(), proc.communicate()
    paused = json.loads(signal_file.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL and b"the rename happened" not in out

    # The kill landed after the new file was fully written and fsynced, and before the rename:
    assert paused["pid"] == proc.pid and paused["path"] == str(path)
    assert os.path.getsize(paused["temp"]) == paused["size"] > 0
    written = torch.load(paused["temp"], weights_only=True)
    assert written["epoch"] == 2 and torch.equal(written["model"]["weight"], torch.full((2, 4), 2.0))
    # ... so the checkpoint is still the previous one, whole.
    model = torch.nn.Linear(4, 2)
    info = ddp_notebook.load_checkpoint(path, model, restore_rng=False)
    assert info.epoch == 1 and torch.equal(model.weight, torch.full((2, 4), 1.0))

    # The next save cleans up the dead process's temporary file.
    ddp_notebook.save_checkpoint(path, model, epoch=3)
    assert not os.path.exists(paused["temp"])
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.rank0.rng", "paused.json"]


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


def test_a_full_filesystem_is_named_and_the_previous_checkpoint_kept(small_filesystem):
    path = small_filesystem / "model.pt"
    small = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(small.weight, 1.0)
    ddp_notebook.save_checkpoint(path, small, epoch=1)
    big = torch.nn.Linear(200, 200)  # about 160 KiB of weights
    with pytest.raises(OSError) as raised:
        ddp_notebook.save_checkpoint(path, big, epoch=2)
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC
    told = re.search(rf"the filesystem of {re.escape(str(path))} is full: the checkpoint needs ([\d.]+) KiB, "
                     rf"([\d.]+) KiB are free there", message)
    assert told, message
    needed, free = map(float, told.groups())
    assert needed > 128 > free > 0
    assert "enforce fail" not in message
    # The previous checkpoint is whole, and no partial file is left.
    assert sorted(os.listdir(small_filesystem)) == ["model.pt", "model.pt.rank0.rng"]
    model = torch.nn.Linear(4, 2)
    info = ddp_notebook.load_checkpoint(path, model, restore_rng=False)
    assert info.epoch == 1 and torch.equal(model.weight, torch.full((2, 4), 1.0))


def _scored_model(score):
    model = torch.nn.Linear(2, 1)
    torch.nn.init.constant_(model.weight, score)
    return model


@pytest.mark.parametrize("mode,keep", [("max", 3), ("min", 2), ("max", 1)])
def test_best_checkpoint_keeps_exactly_the_best_files(tmp_path, mode, keep):
    scores = [0.40, 0.55, 0.50, 0.70, 0.30, 0.65, 0.62, 0.90, 0.10, 0.80]
    best = ddp_notebook.BestCheckpoint(tmp_path / "best.pt", monitor="criteria", mode=mode, keep=keep)
    seen = []
    for epoch, score in enumerate(scores):
        saved = best.update(_scored_model(score), {"criteria": score, "other": 0}, epoch=epoch)
        seen.append((score, epoch))
        ranked = sorted(seen, key=lambda se: se[0], reverse=mode == "max")[:keep]
        assert saved == ((score, epoch) in ranked)
        files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".pt"))
        if keep == 1:
            assert files == ["best.pt"]
            wanted = {"best.pt": ranked[0][0]}
        else:
            wanted = {f"best-epoch{e}.pt": s for s, e in ranked}
            assert files == sorted(wanted)
        assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".rng")) == sorted(f"{f}.rank0.rng" for f in wanted)
        for name, score_kept in wanted.items():
            model = torch.nn.Linear(2, 1)
            info = ddp_notebook.load_checkpoint(tmp_path / name, model, restore_rng=False)
            assert info.extra["criteria"] == score_kept
            assert torch.equal(model.weight, torch.full((1, 2), score_kept))
    assert best.best_score == (0.90 if mode == "max" else 0.10)
    best_epoch = 7 if mode == "max" else 8
    assert best.best_path == str(tmp_path / ("best.pt" if keep == 1 else f"best-epoch{best_epoch}.pt"))
