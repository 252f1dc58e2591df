"""Checkpoints: resume on real gloo ranks, any wrapping, atomic writes under SIGKILL or a full disk, best-k
bookkeeping."""
import contextlib
import errno
import inspect
import json
import os
import random
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
    assert "No RNG state for rank 1" in message and "rank0_only.pt.rank1.rng" in message
    assert "the data order does not depend on it" in message  # the same world size: only random draws differ
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


def _draws():
    return torch.rand(3).tolist(), random.random()


def test_in_the_notebook_loading_leaves_the_random_state_alone_unless_asked(tmp_path):
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddp_notebook.distributed_loader(range(8), batch_size=4)
    torch.manual_seed(21)
    random.seed(21)
    ddp_notebook.save_checkpoint(tmp_path / "c.pt", model, optimizer, epoch=0, loader=loader)
    after_save = _draws()

    target = Net()
    target_optimizer = torch.optim.SGD(target.parameters(), lr=0.1)
    torch.manual_seed(5)
    random.seed(5)
    expected = _draws()
    torch.manual_seed(5)
    random.seed(5)
    ddp_notebook.load_checkpoint(tmp_path / "c.pt", target)
    info = ddp_notebook.load_checkpoint(tmp_path / "c.pt", target, target_optimizer, loader=loader)
    start = ddp_notebook.resume(tmp_path / "c.pt", target, target_optimizer, loader)
    assert info.rng_state is None and start == 1 and start.checkpoint.rng_state is None
    assert _draws() == expected  # outside a job, resuming leaves the notebook's random state its own

    info = ddp_notebook.load_checkpoint(tmp_path / "c.pt", target, target_optimizer, restore_rng=True)
    assert info.rng_state is not None and info.rng_missing_ranks == []
    assert _draws() == after_save  # asked: the draws continue where the saved run was
    start = ddp_notebook.resume(tmp_path / "c.pt", target, target_optimizer, restore_rng=True)
    assert start.checkpoint.rng_state is not None and _draws() == after_save
    ddp_notebook.save_checkpoint(tmp_path / "no_loader.pt", model, epoch=0)
    with pytest.raises(ValueError, match="saved without loader="):
        ddp_notebook.load_checkpoint(tmp_path / "no_loader.pt", Net(), loader=ddp_notebook.distributed_loader(range(4)))


def test_a_loaded_checkpoint_reads_in_one_short_line(tmp_path):
    model = Net()
    ddp_notebook.save_checkpoint(tmp_path / "c.pt", model, torch.optim.Adam(model.parameters()), 3, note="x")
    info = ddp_notebook.load_checkpoint(tmp_path / "c.pt", Net(), restore_rng=True)
    assert info.rng_state is not None  # several KB of state behind it
    assert repr(info) == (f"LoadedCheckpoint({str(tmp_path / 'c.pt')!r}, epoch=3, next_epoch=4, world_size=1, "
                          f"optimizer state, RNG restored, extra=['note'])")
    torch.save(model.state_dict(), tmp_path / "bare.pt")
    assert repr(ddp_notebook.load_checkpoint(tmp_path / "bare.pt", Net())) == \
        f"LoadedCheckpoint({str(tmp_path / 'bare.pt')!r}, epoch=None, next_epoch=0, no optimizer state, " \
        f"not a save_checkpoint file)"
    start = ddp_notebook.resume(tmp_path / "none-yet.pt", Net())
    assert start == 0 and repr(start) == "0" and start.checkpoint is None


def _save_or_resume(path, dataset, save):
    """Save after one epoch, or resume from it; on resuming, what this rank's resume() said and returned."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(100)
    model = DDP(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = ddp_notebook.distributed_loader(dataset, batch_size=40)
    if save:
        for x, y, _ in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        ddp_notebook.save_checkpoint(path, model, optimizer, 0, loader=loader)
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = ddp_notebook.resume(path, model, optimizer, loader)  # RESUME LINE
    return {"start": int(start), "world_size": start.checkpoint.world_size,
            "missing": start.checkpoint.rng_missing_ranks, "restored_rng": start.checkpoint.rng_state is not None,
            "warnings": [(w.category.__name__, str(w.message), w.filename, w.lineno) for w in caught]}


def _resume_line() -> int:
    lines, first = inspect.getsourcelines(_save_or_resume)
    return first + next(i for i, line in enumerate(lines) if "# RESUME LINE" in line)


@pytest.mark.slow
@pytest.mark.parametrize("saved_on,resumed_on", [(3, 2), (2, 3)])
def test_resuming_on_another_world_size_says_so_once_at_the_users_line(tmp_path, saved_on, resumed_on, no_leftovers):
    path = str(tmp_path / "resized.pt")
    dataset = _train_set()
    ddp_notebook.launch(_save_or_resume, (path, dataset, True), cpus=saved_on, seed=1)
    seen = ddp_notebook.launch(_save_or_resume, (path, dataset, False), cpus=resumed_on, seed=2)
    new_ranks = list(range(saved_on, resumed_on))
    for rank, saw in enumerate(seen):
        assert (saw["start"], saw["world_size"], saw["missing"]) == (1, saved_on, new_ranks)
        assert saw["restored_rng"] == (rank < saved_on)
    (category, message, filename, line), = seen[0]["warnings"]  # said once, by rank 0, at the resume() call
    assert all(saw["warnings"] == [] for saw in seen[1:])
    assert (category, filename, line) == ("ResumeWarning", __file__, _resume_line())
    assert message.startswith(f"{path} was saved by {saved_on} ranks and is resumed on {resumed_on}: the global "
                              f"batch size changes ({resumed_on} times the per-rank batch instead of {saved_on} "
                              f"times), and with it each rank's share of every epoch's data and the order it sees "
                              f"it in, so the run will not repeat the one that saved it."), message
    if new_ranks:  # the new rank is named as new, not blamed on a missing file
        assert message.endswith("Rank 2 had no saved RNG state: it keeps its current random state."), message
    else:
        assert "RNG" not in message
    assert ".rng" not in message and "does not depend" not in message


KILLED_SAVE = textwrap.dedent("""
    import os, sys, torch, ddp_notebook
    path, signal_file = sys.argv[1], sys.argv[2]
    sys.path.insert(0, sys.argv[3])
    from checkpoint_pause import pause_before_rename
    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, 1.0)
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    pause_before_rename(path, signal_file)
    torch.nn.init.constant_(model.weight, 2.0)
    ddp_notebook.save_checkpoint(path, model, epoch=2)
    print("the rename happened", flush=True)
""")


def test_sigkill_between_write_and_rename_leaves_the_previous_checkpoint(tmp_path):
    path, signal_file = tmp_path / "model.pt", tmp_path / "paused.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), str(signal_file), os.path.dirname(__file__)],
                            env=env,
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


def test_resumes_start_epoch_travels_as_a_plain_int():
    import pickle

    from ddp_notebook.rank.checkpoint import LoadedCheckpoint, StartEpoch

    start = StartEpoch(3, LoadedCheckpoint("/ckpt.pt", epoch=2, optimizer_state={"state": {}}))
    back = pickle.loads(pickle.dumps(start))  # returned from a rank: the epoch, not the optimizer state it loaded
    assert back == 3 and type(back) is int and start.checkpoint.epoch == 2


def test_a_save_that_ran_out_of_space_is_named_full_even_once_the_space_is_back(tmp_path, monkeypatch):
    """Another writer (another rank's temporary file) holds the disk's last space as this save writes, and gives it
    back at once: torch's zip writer then fails on its own (``unexpected pos``, raised while it handles the ENOSPC),
    and the space is free when the failure is looked at.  The error still says the filesystem was full."""
    from ddp_notebook.wire import safe_files

    failing = {"errno": errno.ENOSPC}

    class OneWriteDoesNotFit:
        def __init__(self, f):
            self.f, self.written, self.failed = f, 0, False

        def write(self, data):
            size = memoryview(data).nbytes
            if self.written + size > 3000 and not self.failed:
                self.failed = True
                raise OSError(failing["errno"], os.strerror(failing["errno"]))
            self.written += size
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    replace_atomically = safe_files.replace_atomically

    @contextlib.contextmanager
    def another_writer_holds_the_space(*args, **kwargs):
        with replace_atomically(*args, **kwargs) as f:
            yield OneWriteDoesNotFit(f)

    monkeypatch.setattr(safe_files, "replace_atomically", another_writer_holds_the_space)
    path = tmp_path / "model.pt"
    with pytest.raises(OSError) as raised:
        ddp_notebook.save_checkpoint(path, torch.nn.Linear(40, 40), epoch=1)  # about 7 KiB
    message = str(raised.value)
    assert raised.value.errno == errno.ENOSPC and "enforce fail" not in message, message
    assert re.search(rf"the filesystem of {re.escape(str(path))} is full: the checkpoint needs [\d.]+ KiB, "
                     rf"[\d.]+ (KiB|MiB) are free there", message), message
    assert isinstance(raised.value.__cause__, RuntimeError)  # torch's own, kept as the cause
    assert os.listdir(tmp_path) == []  # no partial file

    # A save called while the notebook handles an ENOSPC of its own, failing for another reason (an I/O error):
    # that ENOSPC is not the save's, and the disk is not said to be full.
    failing["errno"] = errno.EIO
    try:
        raise OSError(errno.ENOSPC, "the log disk is full")
    except OSError:
        with pytest.raises(Exception) as other:
            ddp_notebook.save_checkpoint(path, torch.nn.Linear(40, 40), epoch=1)
    assert "is full" not in str(other.value) and "unexpected pos" in str(other.value), other.value
    assert os.listdir(tmp_path) == []
