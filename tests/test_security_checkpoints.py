"""Checkpoints in a folder another user may write in, and checkpoints another user made (issue 36, items 1 to 3),
against the real second Unix user of ``test_security_files`` in a 0777 folder without the sticky bit (a group
project folder): a planted sharded checkpoint whose ``.metadata`` or values are malicious pickles is refused naming
the file and runs nothing, in the notebook and in a 2-rank job; an index naming a save outside its folder is
refused; links planted at every name a save writes leave their targets unchanged and the checkpoint whole, ours and
0600; a link put where an evicted best checkpoint was is removed itself, its target left whole.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import stat
import tempfile

import pytest
import torch

import ddp_notebook
from ddp_notebook.rank import checkpoint
from ddp_notebook.rank.checkpoint.reader import UnsafeCheckpointError
from test_security_files import User, other_user, run_as  # noqa: F401 - other_user is a fixture

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def project_folder():
    """A group project folder: root's, mode 0777, not sticky (anyone may add, rename or remove what is in it), in
    /tmp where both users can reach it."""
    path = tempfile.mkdtemp(prefix="ddpnb-project-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    for folder, dirs, files in os.walk(path, topdown=False):  # (the other user's files too)
        for name in files + dirs:
            full = os.path.join(folder, name)
            os.unlink(full) if os.path.islink(full) or not os.path.isdir(full) else os.rmdir(full)
    os.rmdir(path)


@pytest.fixture
def private_folder(tmp_path):
    """A folder of the victim's that the other user cannot enter: where code run as the victim would leave its
    marker, and the victim's own files that planted links aim at."""
    os.chmod(tmp_path, 0o700)
    return tmp_path


class Marker:
    """A pickled value that, when unpickled, makes the folder ``path`` as whoever unpickles it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def _weights() -> dict:
    return {"weight": torch.arange(8.0).reshape(2, 4), "bias": torch.tensor([1.0, -1.0])}


def _plant_sharded_checkpoint(folder: str, extra_values: dict | None = None, name: str = "ck") -> str:
    """A sharded checkpoint folder as save_checkpoint makes it (the other user makes it): ``folder/name``, with
    ``extra_values`` saved beside the model (pickled values of torch.distributed.checkpoint)."""
    import warnings

    from torch.distributed import checkpoint as dcp

    path = os.path.join(folder, name)
    save = "save-1"
    os.makedirs(os.path.join(path, save))
    state = {"model": _weights(), **(extra_values or {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(path, save)), no_dist=True)
    torch.save({"format": checkpoint.FORMAT, "epoch": 3, "sampler_epoch": None, "world_size": 1, "extra": {},
                "optimizer": False}, os.path.join(path, save, checkpoint.SHARDED_META))
    with open(os.path.join(path, checkpoint.SHARDED_INDEX), "w") as f:
        json.dump({"format": checkpoint.SHARDED_FORMAT, "current": save}, f)
    for where, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chmod(os.path.join(where, name), 0o777 if name in dirs else 0o666)
    os.chmod(path, 0o777)
    return path


def _metadata_that_runs(path: str, marker: str) -> None:
    with open(os.path.join(path, "save-1", ".metadata"), "wb") as f:
        pickle.dump(Marker(marker), f)


# -- item 1: a checkpoint folder someone else made runs nothing -------------------------------------------------------

def test_a_planted_metadata_pickle_runs_nothing_and_is_named(other_user, project_folder, private_folder):
    good = run_as(other_user, lambda: _plant_sharded_checkpoint(project_folder, name="good"))
    model = torch.nn.Linear(4, 2)
    assert ddp_notebook.load_checkpoint(good, model).epoch == 3  # the planted folder is a real checkpoint ...
    assert torch.equal(model.weight, _weights()["weight"])
    marker = str(private_folder / "ran")
    path = run_as(other_user, lambda: _plant_sharded_checkpoint(project_folder))
    run_as(other_user, lambda: _metadata_that_runs(path, marker))
    metadata = os.path.join(path, "save-1", ".metadata")

    for attempt in (lambda: ddp_notebook.load_checkpoint(path, torch.nn.Linear(4, 2)),
                    lambda: ddp_notebook.load_checkpoint(path),
                    lambda: ddp_notebook.resume(path, torch.nn.Linear(4, 2))):
        with pytest.raises(UnsafeCheckpointError) as refused:
            attempt()
        assert str(refused.value).startswith(f"{metadata}: not loaded: it names posix.mkdir, which is not part of "
                                             f"a torch.distributed.checkpoint metadata file (nothing in it was run")
        assert not os.path.exists(marker)

    # ... which torch.distributed.checkpoint's own reader would have run:
    from torch.distributed import checkpoint as dcp

    with pytest.raises(Exception):
        dcp.FileSystemReader(os.path.dirname(metadata)).read_metadata()
    assert os.path.isdir(marker)


def test_a_planted_value_pickle_runs_nothing_and_is_named(other_user, project_folder, private_folder):
    marker = str(private_folder / "ran")
    path = run_as(other_user, lambda: _plant_sharded_checkpoint(project_folder, {"note": Marker(marker)}))
    data_file = "__0_0.distcp"  # (what torch.distributed.checkpoint names a single writer's data)
    for attempt in (lambda: ddp_notebook.load_checkpoint(path, torch.nn.Linear(4, 2)),
                    lambda: ddp_notebook.resume(path, torch.nn.Linear(4, 2))):
        with pytest.raises(UnsafeCheckpointError) as refused:
            attempt()
        message = str(refused.value)
        assert message.startswith(f"{os.path.join(path, 'save-1', data_file)}: not loaded: its value 'note' is a "
                                  f"pickled object that torch.load(weights_only=True) refuses, and nothing in it "
                                  f"was run ("), message
        assert "\n" not in message
        assert not os.path.exists(marker)


def _load_planted_into_fsdp(path):
    """In a rank: load the planted checkpoint into an FSDP2 model (every rank reads its own shards); what it
    raised."""
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 2)
    fully_shard(model)
    try:
        ddp_notebook.load_checkpoint(path, model)
    except Exception as exc:  # noqa: BLE001 - told to the test
        return type(exc).__name__, str(exc)
    return "loaded", ""


@pytest.mark.slow
def test_planted_pickles_run_nothing_in_a_two_rank_job(other_user, project_folder, private_folder, no_leftovers):
    marker = str(private_folder / "ran")
    by_metadata = run_as(other_user, lambda: _plant_sharded_checkpoint(project_folder, name="a"))
    run_as(other_user, lambda: _metadata_that_runs(by_metadata, marker))
    # (a value the sharded model asks for: its bias, pickled)
    by_value = run_as(other_user, lambda: _plant_sharded_checkpoint(
        project_folder, {"model": {"weight": _weights()["weight"], "bias": Marker(marker)}}, "b"))
    for path, file_said in ((by_metadata, "/save-1/.metadata: not loaded: it names posix.mkdir"),
                            (by_value, "/save-1/__0_0.distcp: not loaded: its value 'model.bias' is a pickled "
                                       "object")):
        said = ddp_notebook.launch(_load_planted_into_fsdp, (path,), cpus=2)
        assert [kind for kind, _ in said] == ["UnsafeCheckpointError"] * 2, (path, said)
        assert all(message.startswith(path + file_said) for _, message in said), said
        assert not os.path.exists(marker)


@pytest.mark.parametrize("current", ["../elsewhere/save-1", "/tmp/save-1", "save-1/../../elsewhere/save-1", "..",
                                     "save-link"])
def test_an_index_naming_a_save_outside_its_folder_is_refused(other_user, project_folder, current):
    def plant():
        elsewhere = _plant_sharded_checkpoint(project_folder)  # a real save, outside the planted checkpoint
        os.rename(elsewhere, os.path.join(project_folder, "elsewhere"))
        planted = os.path.join(project_folder, "planted")
        os.mkdir(planted, 0o777)
        os.symlink(os.path.join(project_folder, "elsewhere", "save-1"), os.path.join(planted, "save-link"))
        with open(os.path.join(planted, checkpoint.SHARDED_INDEX), "w") as f:
            json.dump({"format": checkpoint.SHARDED_FORMAT, "current": current}, f)
        return planted

    planted = run_as(other_user, plant)
    assert ddp_notebook.load_checkpoint(os.path.join(project_folder, "elsewhere")).epoch == 3  # (a real one)
    with pytest.raises(ValueError) as refused:
        ddp_notebook.resume(planted, torch.nn.Linear(4, 2))
    index = os.path.join(planted, checkpoint.SHARDED_INDEX)
    assert str(refused.value) in (
        f"{index} names {current!r} as its current save: not loaded, a save is a folder save-… inside {planted}",
        f"{index} names the save {current}, which is a symbolic link of {other_user.name}'s, not a folder: not "
        f"loaded")


# -- item 2: a save writes no file but its own ------------------------------------------------------------------------

def _plant_links(folder: str, names: list[str], target: str) -> None:
    for name in names:
        os.symlink(target, os.path.join(folder, name))


def _file_is_ours(path: str, mode: int = 0o600) -> None:
    st = os.lstat(path)
    assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == mode, \
        (path, st)


def test_links_at_every_name_a_save_writes_are_not_followed(other_user, project_folder, private_folder):
    secret = private_folder / "secret.txt"
    secret.write_text("mine")
    secret.chmod(0o600)
    path = os.path.join(project_folder, "model.pt")
    host, pid = socket.gethostname(), os.getpid()
    names = ["model.pt", "model.pt.rank0.rng"]
    for base in ("model.pt", "model.pt.rank0.rng"):
        names += [f".{base}.tmp-{host}-{pid}-{n}" for n in range(64)]  # the names saves used to write
        names += [f".{base}.tmp-{host}-1-{n}" for n in range(4)]  # "stale temps" of a dead process: links
    run_as(other_user, lambda: _plant_links(project_folder, names, str(secret)))
    dead_pid_file = os.path.join(project_folder, f".model.pt.tmp-{host}-1-theirs")
    run_as(other_user, lambda: open(dead_pid_file, "w").close())

    model = torch.nn.Linear(4, 2)
    ddp_notebook.save_checkpoint(path, model, epoch=1)
    ddp_notebook.save_checkpoint(path, model, epoch=2)  # (a second save: the stale-temp clean-up runs over them)

    assert secret.read_text() == "mine" and stat.S_IMODE(secret.stat().st_mode) == 0o600
    for file in (path, checkpoint.rng_path(path, 0)):
        _file_is_ours(file)  # the links at the checkpoint's own names were replaced themselves
    left = set(os.listdir(project_folder))
    assert {n for n in names if n not in ("model.pt", "model.pt.rank0.rng")} <= left  # not followed, not removed
    assert os.path.basename(dead_pid_file) in left  # another user's file is never removed as a stale temp
    assert left - set(names) - {os.path.basename(dead_pid_file)} == set()  # no temp of ours left behind
    loaded = ddp_notebook.load_checkpoint(path, torch.nn.Linear(4, 2))
    assert loaded.epoch == 2


def test_a_save_is_0600_unless_file_mode_says_otherwise(tmp_path):
    old = os.umask(0o000)  # the umask no longer decides
    try:
        ddp_notebook.save_checkpoint(tmp_path / "a.pt", torch.nn.Linear(4, 2))
        ddp_notebook.save_checkpoint(tmp_path / "b.pt", torch.nn.Linear(4, 2), file_mode=0o640)
        best = ddp_notebook.BestCheckpoint(tmp_path / "best.pt", file_mode=0o644)
        best.update(torch.nn.Linear(4, 2), 1.0)
    finally:
        os.umask(old)
    for name, mode in (("a.pt", 0o600), ("a.pt.rank0.rng", 0o600), ("b.pt", 0o640), ("b.pt.rank0.rng", 0o640),
                       ("best.pt", 0o644)):
        _file_is_ours(str(tmp_path / name), mode)
    assert checkpoint.load_checkpoint(tmp_path / "b.pt").extra == {}  # (file_mode is no extra value)


def _save_sharded(path, file_mode):
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Linear(4, 2)
    fully_shard(model)
    ddp_notebook.save_checkpoint(path, model, epoch=1, file_mode=file_mode)


@pytest.mark.slow
def test_a_sharded_save_is_private_and_refuses_a_planted_link(other_user, project_folder, private_folder,
                                                              no_leftovers):
    victim = private_folder / "victim"
    victim.mkdir()
    (victim / "notes.txt").write_text("mine")
    linked = os.path.join(project_folder, "linked")
    run_as(other_user, lambda: os.symlink(str(victim), linked))
    with pytest.raises(ddp_notebook.RankError, match=f"{linked} is a symbolic link of {other_user.name}'s: a "
                                                     f"checkpoint is saved only into a folder of yours"):
        ddp_notebook.launch(_save_sharded, (linked, 0o600), cpus=2)
    assert os.listdir(victim) == ["notes.txt"] and (victim / "notes.txt").read_text() == "mine"

    for name, mode in (("private", 0o600), ("group", 0o640)):
        path = os.path.join(project_folder, name)
        ddp_notebook.launch(_save_sharded, (path, mode), cpus=2)
        folder_mode = mode | (mode & 0o444) >> 2
        for where, dirs, files in os.walk(path):
            st = os.lstat(where)
            assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == folder_mode, (where, oct(st.st_mode))
            for file in files:
                _file_is_ours(os.path.join(where, file), mode)
        assert ddp_notebook.load_checkpoint(path).epoch == 1


# -- item 3: eviction never deletes through a link ------------------------------------------------------------------

def test_a_link_in_place_of_an_evicted_best_is_removed_itself(other_user, project_folder, private_folder):
    elsewhere = private_folder / "other_run"  # another checkpoint folder of the victim's, as eviction removes them
    (elsewhere / "save-1").mkdir(parents=True)
    (elsewhere / "save-1" / "weights").write_text("mine")
    (elsewhere / checkpoint.SHARDED_INDEX).write_text("{}")
    best = ddp_notebook.BestCheckpoint(os.path.join(project_folder, "best.pt"), keep=2)
    model = torch.nn.Linear(4, 2)
    best.update(model, 1.0, epoch=0)
    best.update(model, 2.0, epoch=1)
    first = os.path.join(project_folder, "best-epoch0.pt")

    def swap():
        os.unlink(first)
        os.symlink(str(elsewhere), first)

    run_as(other_user, swap)
    best.update(model, 3.0, epoch=2)  # evicts best-epoch0.pt: now the link
    assert not os.path.lexists(first)
    assert sorted(os.listdir(elsewhere)) == [checkpoint.SHARDED_INDEX, "save-1"]
    assert (elsewhere / "save-1" / "weights").read_text() == "mine"
    assert [p for _, p in best.kept] == [os.path.join(project_folder, f"best-epoch{e}.pt") for e in (2, 1)]


def test_another_user_s_folder_in_place_of_an_evicted_best_is_left(other_user, project_folder):
    best = ddp_notebook.BestCheckpoint(os.path.join(project_folder, "best-{epoch}.pt"), keep=1)
    model = torch.nn.Linear(4, 2)
    best.update(model, 1.0, epoch=0)
    first = os.path.join(project_folder, "best-0.pt")

    def swap():
        os.unlink(first)
        os.mkdir(first, 0o755)
        open(os.path.join(first, checkpoint.SHARDED_INDEX), "w").close()
        os.mkdir(os.path.join(first, "save-theirs"))

    run_as(other_user, swap)
    best.update(model, 2.0, epoch=1)
    assert sorted(os.listdir(first)) == [checkpoint.SHARDED_INDEX, "save-theirs"]
