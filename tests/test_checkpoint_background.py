"""Checkpoints written in the background (``save_checkpoint(..., background=True)``) on real gloo ranks: what is
written is the state at the call though training changes it in place at once (generated DDP and FSDP2 models,
dtypes, uneven shards, AdamW step counts, RNG, extras, sampler epoch); a rank killed mid-write and a full disk leave
the previous checkpoint loadable and the error names the path; one save in flight per path."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddp_notebook
from ddp_notebook.rank import background_saves, checkpoint
from checkpoint_pause import pause_before_rename

pytestmark = [pytest.mark.timeout(300)]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
OPTIMIZERS = ("adamw", "sgd", "adam")


class Generated(torch.nn.Module):
    """A chain of linear layers of the spec's widths and dtype, each optionally with a buffer."""

    def __init__(self, spec):
        super().__init__()
        dims, dtype = spec["dims"], DTYPES[spec["dtype"]]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b, dtype=dtype) for a, b in zip(dims, dims[1:]))
        for i in spec["buffers"]:
            self.layers[i].register_buffer("stat", torch.randn(dims[i + 1]).to(dtype))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if hasattr(layer, "stat"):
                layer.stat.add_(1)  # a buffer the training changes in place too
        return x


@st.composite
def model_specs(draw):
    dims = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))  # widths 1..9: uneven shards on 2 ranks
    layers = len(dims) - 1
    return {"dims": dims, "dtype": draw(st.sampled_from(sorted(DTYPES))),
            "buffers": draw(st.lists(st.sampled_from(range(layers)), unique=True)),
            "optimizer": draw(st.sampled_from(OPTIMIZERS))}


def _build(spec, seed, wrap):
    torch.manual_seed(seed)
    model = Generated(spec)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    kind = spec["optimizer"]
    params = model.parameters()
    optimizer = torch.optim.AdamW(params, lr=0.1) if kind == "adamw" else torch.optim.Adam(params, lr=0.1) \
        if kind == "adam" else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return model, optimizer


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _whole_state(model, optimizer):
    """Copies of every tensor of the model and of the optimizer's state (steps included), whole, by name."""
    plain = ddp_notebook.unwrap_model(model)
    weights = {k: _full(v).detach().clone() for k, v in plain.state_dict().items()}
    state = {name: {k: _full(v).clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state[p].items()}
             for name, p in plain.named_parameters()}
    return weights, state


def _step(model, optimizer, spec, seed):
    x = torch.randn(3, spec["dims"][0], generator=torch.Generator().manual_seed(seed)).to(DTYPES[spec["dtype"]])
    optimizer.zero_grad()
    model(x).float().square().mean().backward()
    optimizer.step()


class _HeldWrites:
    """Holds every ``torch.save`` of a thread other than the one that made it (the background writes) until
    :meth:`release`: what they write is what was staged, however long the training went on changing the state."""

    def __init__(self):
        self.gate = threading.Event()
        self.held = 0
        self._save = torch.save
        trainer = threading.current_thread()

        def held_save(*args, **kwargs):
            if threading.current_thread() is not trainer:
                self.held += 1
                assert self.gate.wait(60), "the test never released the background write"
            return self._save(*args, **kwargs)

        torch.save = held_save

    def release(self):
        self.gate.set()

    def restore(self):
        self.gate.set()
        torch.save = self._save


def _save_in_background_while_training(specs, workdir, wrap):
    """Each spec: a step, a background save, at once two more steps, RNG draws, an extra changed in place, an epoch
    of the loader; then the write is let through.  What each rank held at the call."""
    import torch.distributed as dist

    rank = dist.get_rank()
    loader = ddp_notebook.distributed_loader(torch.utils.data.TensorDataset(torch.arange(10)), batch_size=2)
    out = []
    held = _HeldWrites()
    try:
        for i, spec in enumerate(specs):
            model, optimizer = _build(spec, seed=i, wrap=wrap)
            _step(model, optimizer, spec, seed=i)
            list(loader)
            seen = torch.full((4,), float(i))
            path = os.path.join(workdir, f"model{i}")
            ddp_notebook.save_checkpoint(path, model, optimizer, i, loader=loader, background=True, seen=seen,
                                         index=i)
            expected = {"state": _whole_state(model, optimizer), "rng": torch.get_rng_state(),
                        "sampler_epoch": loader.next_epoch, "seen": seen.clone()}
            in_flight = background_saves.in_flight(path) is not None
            _step(model, optimizer, spec, seed=100 + i)  # the state changes in place while the write waits
            _step(model, optimizer, spec, seed=200 + i)
            torch.rand(7)
            seen.add_(1)
            list(loader)
            expected["after"] = _whole_state(model, optimizer)
            held.release()
            background_saves.wait(path)
            held.gate.clear()
            expected["in_flight"] = in_flight
            expected["held"] = held.held
            out.append(expected)
    finally:
        held.restore()
    return rank, out


def _rng_of(path, rank, sharded):
    if sharded:
        with open(os.path.join(path, checkpoint.SHARDED_INDEX)) as f:
            folder = os.path.join(path, json.load(f)["current"])
        return torch.load(os.path.join(folder, f"rank{rank}.rng"), weights_only=True)["state"]["torch"]
    tag = torch.load(path, weights_only=True)["rng_tag"]  # the save the model file belongs to
    return torch.load(checkpoint.rng_path(path, rank), weights_only=True)["saves"][tag]["torch"]


def _assert_same(got, expected, what):
    assert got.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), f"{what}: {key}"
        else:
            assert got[key] == value, f"{what}: {key}"


def _check_loaded(specs, workdir, ranks, sharded):
    for i, spec in enumerate(specs):
        path = os.path.join(workdir, f"model{i}")
        for rank, out in ranks:
            expected = out[i]
            assert expected["in_flight"] and expected["held"] > 0  # the write had not begun when the state changed
            assert torch.equal(_rng_of(path, rank, sharded), expected["rng"]), f"rank {rank}'s RNG, model {i}"
        weights, optimizer_state = ranks[0][1][i]["state"]
        after, _ = ranks[0][1][i]["after"]
        assert any(not torch.equal(after[k], weights[k]) for k in weights)  # (the steps did change it)
        model, optimizer = _build(spec, seed=1000 + i, wrap="plain")
        info = ddp_notebook.load_checkpoint(path, model, optimizer, restore_rng=False)
        assert (info.epoch, info.world_size, info.sharded, info.sampler_epoch) == (i, 2, sharded,
                                                                                   ranks[0][1][i]["sampler_epoch"])
        assert info.extra["index"] == i and torch.equal(info.extra["seen"], ranks[0][1][i]["seen"])
        _assert_same(model.state_dict(), weights, f"weights of model {i} ({spec})")
        for name, p in model.named_parameters():
            _assert_same(optimizer.state[p], optimizer_state[name], f"optimizer state of {name}, model {i} ({spec})")


SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("kind", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
@SETTINGS
@given(specs=st.lists(model_specs(), min_size=2, max_size=3))
def test_a_background_save_is_the_state_at_the_call(kind, specs, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp(kind))
    ranks = ddp_notebook.launch(_save_in_background_while_training, (specs, workdir, kind), cpus=2)
    _check_loaded(specs, workdir, ranks, sharded=kind == "fsdp2")


# -- one save in flight per path; loads wait ----------------------------------------------------------

def test_a_load_waits_for_the_background_save_of_its_path_and_a_save_for_the_one_before(tmp_path):
    path = str(tmp_path / "model.pt")
    model = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(model.weight, 1.0)
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    held = _HeldWrites()
    try:
        torch.nn.init.constant_(model.weight, 2.0)
        ddp_notebook.save_checkpoint(path, model, epoch=2, background=True)
        torch.nn.init.constant_(model.weight, 3.0)
        assert background_saves.in_flight(path) is not None
        threading.Timer(0.3, held.release).start()
        loaded = torch.nn.Linear(4, 2)
        assert ddp_notebook.load_checkpoint(path, loaded).epoch == 2  # not the previous one: it waited
        assert torch.equal(loaded.weight, torch.full((2, 4), 2.0))
        held.gate.clear()
        ddp_notebook.save_checkpoint(path, model, epoch=3, background=True)
        threading.Timer(0.3, held.release).start()
        torch.nn.init.constant_(model.weight, 4.0)
        ddp_notebook.save_checkpoint(path, model, epoch=4, background=True)  # waits for epoch 3's write first
        held.release()
        assert ddp_notebook.resume(path, loaded) == 5
        assert torch.equal(loaded.weight, torch.full((2, 4), 4.0))
        held.gate.clear()
        ddp_notebook.save_checkpoint(path, model, epoch=5, background=True)
        threading.Timer(0.3, held.release).start()
        ddp_notebook.wait_for_checkpoints()  # (what a rank does before another rank reads the file)
        assert torch.load(path, weights_only=True)["epoch"] == 5  # a plain read, which waits for nothing
    finally:
        held.restore()
    background_saves.finish()
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.rank0.rng"]


def test_best_checkpoints_in_the_background_keep_exactly_the_best_files(tmp_path):
    best = ddp_notebook.BestCheckpoint(str(tmp_path / "best.pt"), monitor="acc", keep=2, background=True)
    model = torch.nn.Linear(3, 1)
    for epoch, score in enumerate([0.1, 0.5, 0.3, 0.9, 0.2]):
        torch.nn.init.constant_(model.weight, score)
        best.update(model, {"acc": score}, epoch=epoch)
        torch.nn.init.constant_(model.weight, -1.0)  # changed at once: the write is of the state at the call
    background_saves.finish()
    assert [s for s, _ in best.kept] == [0.9, 0.5]
    assert sorted(os.listdir(tmp_path)) == ["best-epoch1.pt", "best-epoch1.pt.rank0.rng", "best-epoch3.pt",
                                            "best-epoch3.pt.rank0.rng"]
    for score, file in best.kept:
        loaded = torch.nn.Linear(3, 1)
        assert ddp_notebook.load_checkpoint(file, loaded).extra["acc"] == score
        assert torch.equal(loaded.weight, torch.full((1, 3), score))


def test_a_staging_copy_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    path = str(tmp_path / "model.pt")
    model = torch.nn.Linear(256, 256)  # 257 KiB of weights and bias
    monkeypatch.setattr(background_saves, "available_memory", lambda: background_saves.HEADROOM_BYTES + 100 * 2**10)
    with pytest.raises(ddp_notebook.StagingMemoryError) as refused:
        ddp_notebook.save_checkpoint(path, model, epoch=1, background=True)
    assert str(refused.value).startswith(f"save_checkpoint({path!r}, background=True) needs 257.0 KiB of CPU memory "
                                         f"for its staging copy of this rank's state (0 bytes of it already held), "
                                         f"and 256.1 MiB are available, of which 256.0 MiB are left to the rest: "
                                         f"nothing was saved; save with background=False")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    ddp_notebook.save_checkpoint(path, model, epoch=1, background=True)  # with the memory it needs
    background_saves.finish()
    assert ddp_notebook.load_checkpoint(path).epoch == 1


# -- a full disk, a killed rank ---------------------------------------------------------------------


def _fill_in_the_background(path, then_save_again):
    """A small checkpoint, then a background save that does not fit; the next save (or the task's end) raises.

    Rank 0 alone fills the disk: rank 1 writes its part of each save (its RNG file) before rank 0's model file
    of the save that does not fit starts, so that no write of rank 1's meets the full disk (one that did would
    fail rank 1 first, and rightly so)."""
    import torch.distributed as dist

    small = torch.nn.Linear(4, 2)
    torch.nn.init.constant_(small.weight, 1.0)
    ddp_notebook.save_checkpoint(path, small, epoch=1)
    big = torch.nn.Linear(200, 200)  # about 160 KiB of weights
    if dist.get_rank() != 0:
        ddp_notebook.save_checkpoint(path, big, epoch=2, background=True)
        ddp_notebook.wait_for_checkpoints(path)
    dist.barrier()
    if dist.get_rank() == 0:
        ddp_notebook.save_checkpoint(path, big, epoch=2, background=True)
        if then_save_again:
            try:
                ddp_notebook.save_checkpoint(path, small, epoch=3)
            except ddp_notebook.BackgroundSaveError as exc:
                return {"raised": str(exc), "cause_errno": exc.__cause__.errno}
    return {"raised": None}


def test_a_full_disk_under_a_background_save_is_raised_naming_the_path_and_the_previous_checkpoint_kept(
        small_filesystem, no_leftovers):
    path = str(small_filesystem / "model.pt")
    ranks = ddp_notebook.launch(_fill_in_the_background, (path, True), cpus=2)
    raised = ranks[0]["raised"]  # rank 0 writes the model: its next save raises
    assert raised and raised.startswith(f"the background save of {path} failed: OSError: ")
    assert f"the filesystem of {path} is full" in raised and ranks[0]["cause_errno"] == errno.ENOSPC
    model = torch.nn.Linear(4, 2)
    info = ddp_notebook.load_checkpoint(path, model, restore_rng=False)  # (the save that raised wrote nothing)
    assert info.epoch == 1 and torch.equal(model.weight, torch.full((2, 4), 1.0))

    with pytest.raises(ddp_notebook.RankError) as failed:  # no next save: the task's end raises it
        ddp_notebook.launch(_fill_in_the_background, (path, False), cpus=2)
    message = str(failed.value)
    assert "rank 0 failed: BackgroundSaveError: the background save of " in message and path in message, message
    assert ddp_notebook.load_checkpoint(path, model, restore_rng=False).epoch == 1
    assert not [n for n in os.listdir(small_filesystem) if ".tmp-" in n]  # no partial file left


KILLED_SAVE = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, sys.argv[3])
    import ddp_notebook
    from test_checkpoint_background import _saves_then_paused_in_the_background
    try:
        ddp_notebook.launch(_saves_then_paused_in_the_background, (sys.argv[1], sys.argv[2]), cpus=2)
    except ddp_notebook.RankError as exc:
        print("launch failed:", str(exc).splitlines()[0], flush=True)
""")


def _saves_then_paused_in_the_background(path, signal_file):
    """Save weights of 1; then a background save of weights of 2, whose write rank 0 pauses (for the test to kill
    it) after the new file is written and fsynced, before it is renamed into place; training goes on meanwhile."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 2))
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    torch.save(torch.get_rng_state(), f"{signal_file}.rng{dist.get_rank()}")  # this rank's RNG at the first save
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    torch.rand(3)  # (the second save's RNG state differs)
    pause_before_rename(path, signal_file)
    with torch.no_grad():
        model.module.weight.fill_(2.0)
    ddp_notebook.save_checkpoint(path, model, epoch=2, background=True)
    with open(f"{signal_file}.returned{dist.get_rank()}", "w"):
        pass  # the call has returned, the write goes on
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()  # training goes on (collectives included)


def test_a_rank_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, no_leftovers):
    path, signal_file = tmp_path / "model.pt", tmp_path / "paused.json"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(path), str(signal_file),
                             os.path.dirname(__file__)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not signal_file.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert signal_file.exists(), proc.communicate()
        paused = json.loads(signal_file.read_text())
        assert os.path.exists(f"{signal_file}.returned0")  # the save returned before its write was done
        while not _has_rng_of_epoch(path, 1, 2) and time.time() < deadline:
            time.sleep(0.05)  # rank 1 renames its RNG file of the new save into place, ahead of rank 0's model
        assert _has_rng_of_epoch(path, 1, 2)
        os.kill(paused["pid"], signal.SIGKILL)  # rank 0, its new file written and fsynced, not yet renamed
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "launch failed: rank 0 failed: RankDied: rank 0 was killed by SIGKILL" in out, (out, err)
    written = torch.load(paused["temp"], weights_only=True)  # the new checkpoint was whole on disk ...
    assert written["epoch"] == 2 and torch.equal(written["model"]["weight"], torch.full((2, 4), 2.0))
    model = torch.nn.Linear(4, 2)
    info = ddp_notebook.load_checkpoint(path, model, restore_rng=False)  # ... and the checkpoint is the previous one
    assert info.epoch == 1 and torch.equal(model.weight, torch.full((2, 4), 1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ddp_notebook.ResumeWarning)  # (a resume that would not repeat the run warns)
        resumed = ddp_notebook.launch(_resumes_with_rng, (str(path),), cpus=2)
    for rank in (0, 1):  # every rank's random state is the one of the previous checkpoint's save
        assert resumed[rank][0] == [] and torch.equal(resumed[rank][1],
                                                      torch.load(f"{signal_file}.rng{rank}", weights_only=True))


def _has_rng_of_epoch(path, rank, epoch):
    """Whether rank ``rank``'s RNG file beside ``path`` has the state of a save of ``epoch`` (tags: job/epoch/count)."""
    try:
        saves = torch.load(checkpoint.rng_path(str(path), rank), weights_only=True)["saves"]
    except (FileNotFoundError, EOFError, RuntimeError):
        return False
    return any(tag.split("/")[-2] == str(epoch) for tag in saves)


def _resumes_with_rng(path):
    import warnings as _warnings
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(4, 2))
    with _warnings.catch_warnings():
        _warnings.simplefilter("error", ddp_notebook.ResumeWarning)
        info = ddp_notebook.load_checkpoint(path, model, restore_rng=True)
    return info.rng_missing_ranks, torch.get_rng_state()


# -- the dashboard ------------------------------------------------------------------------------------

def _saves_once_in_the_background(path):
    ddp_notebook.save_checkpoint(path, torch.nn.Linear(64, 64), epoch=1, background=True)


def test_the_dashboard_shows_a_background_save_and_how_long_the_training_was_blocked(tmp_path):
    from ddp_notebook.notebook import dashboard

    path = str(tmp_path / "last.pt")
    seen = []
    real = dashboard.saving_text

    def shown(body):
        seen.append(body)
        return real(body)

    dashboard.saving_text = shown
    try:
        ddp_notebook.launch(_saves_once_in_the_background, (path,), cpus=2)
    finally:
        dashboard.saving_text = real
    watcher, = [w for w in ddp_notebook.last_job().listeners if isinstance(w, dashboard.Watcher)]
    started, written = seen  # rank 0's save alone: it is the one that writes the model
    assert started["path"] == written["path"] == path and started["written_s"] is None
    assert written["blocked_s"] == started["blocked_s"] > 0 and written["written_s"] > 0
    blocked = f"{started['blocked_s']:.2f}"
    assert dashboard.saving_text(started) == f"saving last.pt in the background (training blocked {blocked} s)"
    assert watcher.status.saving == (f"last.pt saved in the background (training blocked {blocked} s, written in "
                                     f"{written['written_s']:.1f} s)")
    watcher.status.outcome = None  # as while the job runs: the status line shows it last
    assert watcher.status.line(None, time.time()).endswith(" · " + watcher.status.saving)
    assert dashboard.saving_text({**written, "error": "OSError: no space"}) == \
        f"background save of last.pt failed (training blocked {blocked} s)"


def _sharded_saves_to_two_paths(workdir):
    """An FSDP2 model saved in the background to two paths in turn, a step between the saves."""
    spec = {"dims": [5, 9, 3], "dtype": "fp32", "buffers": [0], "optimizer": "adamw"}
    model, optimizer = _build(spec, seed=0, wrap="fsdp2")
    states = []
    for i in range(4):
        _step(model, optimizer, spec, seed=i)
        ddp_notebook.save_checkpoint(os.path.join(workdir, "ab"[i % 2]), model, optimizer, i, background=True)
        states.append(_whole_state(model, optimizer)[0])
    ddp_notebook.wait_for_checkpoints()
    return states


@pytest.mark.slow
def test_background_saves_of_a_sharded_model_to_two_paths_go_one_at_a_time(tmp_path, no_leftovers):
    states = ddp_notebook.launch(_sharded_saves_to_two_paths, (str(tmp_path),), cpus=2)[0]
    spec = {"dims": [5, 9, 3], "dtype": "fp32", "buffers": [0], "optimizer": "adamw"}
    for name, epoch in (("a", 2), ("b", 3)):
        model, _ = _build(spec, seed=9, wrap="plain")
        assert ddp_notebook.load_checkpoint(str(tmp_path / name), model).epoch == epoch
        _assert_same(model.state_dict(), states[epoch], f"checkpoint {name}")


def _sharded_save_one_rank_cannot_stage(path):
    """Rank 1 has no memory for its staging copy: every rank refuses the save; a blocking save then goes through."""
    import torch.distributed as dist

    spec = {"dims": [5, 9, 3], "dtype": "fp32", "buffers": [], "optimizer": "adamw"}
    model, optimizer = _build(spec, seed=0, wrap="fsdp2")
    if dist.get_rank() == 1:
        background_saves.available_memory = lambda: 0
    try:
        ddp_notebook.save_checkpoint(path, model, optimizer, 1, background=True)
        refused = None
    except ddp_notebook.StagingMemoryError as exc:
        refused = str(exc)
    written = os.listdir(path) if os.path.isdir(path) else []
    dist.barrier()
    ddp_notebook.save_checkpoint(path, model, optimizer, 2)
    return refused, written


@pytest.mark.slow
def test_a_sharded_save_that_one_rank_cannot_stage_is_refused_on_every_rank(tmp_path, no_leftovers):
    path = str(tmp_path / "fsdp")
    ranks = ddp_notebook.launch(_sharded_save_one_rank_cannot_stage, (path,), cpus=2)
    for refused, written in ranks:
        assert refused.startswith("Rank 1 cannot stage a copy of its part of the checkpoint, so no rank saves it: "
                                  f"rank 1: save_checkpoint({path!r}, background=True) needs "), refused
        assert checkpoint.SHARDED_INDEX not in written  # no checkpoint was made
    assert ddp_notebook.load_checkpoint(path).epoch == 2


# -- a graceful stop ----------------------------------------------------------------------------------

def _trains_saving_slowly_in_the_background(path, marks):
    """Each epoch a background save whose write takes a second (the write sleeps first); marks the epochs whose
    save call returned."""
    import time

    import torch.distributed as dist

    save = torch.save
    trainer = threading.current_thread()

    def slow_save(*args, **kwargs):
        if threading.current_thread() is not trainer:
            time.sleep(1.0)
        return save(*args, **kwargs)

    torch.save = slow_save
    model = torch.nn.Linear(4, 2)
    loader = ddp_notebook.distributed_loader(torch.utils.data.TensorDataset(torch.randn(40, 4)), batch_size=2)
    for epoch in range(1000):
        for _ in loader:
            time.sleep(0.01)
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        ddp_notebook.save_checkpoint(path, model, epoch=epoch, background=True)
        if dist.get_rank() == 0:
            with open(os.path.join(marks, str(epoch)), "w"):
                pass


def test_a_graceful_stop_ends_the_task_once_its_background_write_is_on_disk(tmp_path, no_leftovers):
    path, marks = str(tmp_path / "last.pt"), tmp_path / "marks"
    marks.mkdir()
    job = ddp_notebook.launch(_trains_saving_slowly_in_the_background, (path, str(marks)), cpus=2, background=True)
    deadline = time.monotonic() + 60
    while len(os.listdir(marks)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.stop()
    assert job.wait() == [None, None] and job.status == "stopped"
    last = max(int(name) for name in os.listdir(marks))
    saved = torch.load(path, weights_only=True)  # read at once: the job's end waited for the write
    assert saved["epoch"] == last and torch.equal(saved["model"]["weight"], torch.full((2, 4), float(last)))


# -- the kernel interrupted during a background write ---------------------------------------------------------

INTERRUPTED_CELL = '''%%ddp --cpus 2
import os, sys, time
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(4, 2))
with torch.no_grad():
    model.module.weight.fill_(1.0)
ddp_notebook.save_checkpoint({path!r}, model, epoch=1)
sys.path.insert(0, {tests!r})
from checkpoint_pause import pause_before_rename
pause_before_rename({path!r}, {signal_file!r})  # rank 0's write stops before its rename, for the interrupt to come
with torch.no_grad():
    model.module.weight.fill_(2.0)
ddp_notebook.save_checkpoint({path!r}, model, epoch=2, background=True)
print("PID", os.getpid(), flush=True)
time.sleep(600)  # no batch boundary: the interrupt stops the cell hard
'''


@pytest.mark.kernel
def test_the_kernel_interrupted_during_a_background_write_leaves_the_previous_checkpoint(tmp_path, no_leftovers):
    from nbrun import gone, kernel, run_cell, run_until_pids, until_idle

    path, signal_file = str(tmp_path / "model.pt"), str(tmp_path / "paused.json")
    with kernel("%load_ext ddp_notebook\nimport torch, ddp_notebook") as (km, kc):
        msg_id, pids = run_until_pids(kc, INTERRUPTED_CELL.format(path=path, signal_file=signal_file,
                                                                   tests=os.path.dirname(__file__)))
        deadline = time.monotonic() + 60
        while not os.path.exists(signal_file) and time.monotonic() < deadline:
            time.sleep(0.05)
        paused = json.loads(open(signal_file).read())  # rank 0's new file is written and fsynced, not renamed
        km.interrupt_kernel()
        reply, told = until_idle(kc, msg_id)
        assert reply["ename"] == "KeyboardInterrupt", told
        assert gone(pids, 10), "a rank outlived the interrupt"
        reply, told = run_cell(kc, f"model = torch.nn.Linear(4, 2)\n"
                                   f"info = ddp_notebook.load_checkpoint({path!r}, model, restore_rng=False)\n"
                                   f"print(info.epoch, bool((model.weight == 1).all()))")
        assert reply["status"] == "ok" and told.strip() == "1 True", told  # the previous checkpoint, whole
    written = torch.load(paused["temp"], weights_only=True)  # the new one was whole, and never became visible
    assert written["epoch"] == 2 and torch.equal(written["model"]["weight"], torch.full((2, 4), 2.0))
    ddp_notebook.save_checkpoint(path, torch.nn.Linear(4, 2), epoch=3)  # the next save removes what was left
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.rank0.rng", "model.pt.rank1.rng", "paused.json"]
    assert torch.load(path, weights_only=True)["epoch"] == 3
