"""Another user of the machine, not trusted: GPU reservations, Slurm run files and exports against a real second
Unix user (made with ``useradd``; its commands run in a child that has taken its uid, or with ``runuser``).

The attacks of issue 28: a symbolic link planted where a lock file goes, a lock file unlinked under its holder, a
FIFO as a waiting ticket, a folder another user made first, a GPU held forever, forged Slurm run files and a
pre-created export temp file.  The user is made once (idempotent); without root these tests skip with the reason,
and under ``CI=true`` they fail (``.ci/run`` runs as root).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass

import psutil
import pytest

import fake_nvml
from conftest import ROOT
from ddp_notebook.engine import devices as gpus, reservations, spec as job_spec
from ddp_notebook.notebook import picker
from ddp_notebook.wire.errors import LaunchError

OTHER = "ddpnb-other"
GPU0, GPU1 = fake_nvml.UUIDS[0], fake_nvml.UUIDS[1]


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="session")
def other_user() -> User:
    """A second Unix user, made with useradd when missing."""
    if os.geteuid() != 0:
        why = "a second Unix user needs root (useradd, setuid); .ci/run runs the tests as root"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER],
                       check=True, capture_output=True)
    entry = pwd.getpwnam(OTHER)
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def as_user(user: User, action):
    """Run ``action()`` in a forked child that has become ``user``; yields (the child's pid, what it returned).
    The child keeps what it opened (its locks) until the block ends."""
    said_r, said_w = os.pipe()
    end_r, end_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(said_r)
            os.close(end_w)
            os.setgroups([])
            os.setgid(user.gid)
            os.setuid(user.uid)
            try:
                said = ("ok", action())
            except BaseException as exc:  # noqa: BLE001 - told to the test
                said = ("error", traceback.format_exc())
            with os.fdopen(said_w, "wb") as f:
                pickle.dump(said, f)
            os.read(end_r, 1)  # the block has ended
            code = 0
        finally:
            os._exit(code)
    os.close(said_w)
    os.close(end_r)
    try:
        with os.fdopen(said_r, "rb") as f:
            outcome, value = pickle.load(f)
        assert outcome == "ok", value
        yield pid, value
    finally:
        os.close(end_w)
        os.waitpid(pid, 0)


def run_as(user: User, action):
    """What ``action()`` returns, run as ``user``."""
    with as_user(user, action) as (_, value):
        return value


@pytest.fixture
def shared_folder(monkeypatch):
    """An administrator's folder of reservations for every user: root's, mode 1777 (in /tmp, which both users
    can reach; the tests' own TMPDIR is private)."""
    path = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    os.chmod(path, 0o1777)
    monkeypatch.setenv(reservations.DIR_ENV, path)
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(job_spec, "_default_devices", None)
    monkeypatch.setattr(picker, "_active", None)
    yield path
    shutil.rmtree(path)


def _lock_path(folder: str, uuid: str) -> str:
    return os.path.join(folder, uuid + reservations.LOCK_SUFFIX)


def _holder_process(uuids):
    """Another process of this user that holds ``uuids``; ends when killed."""
    code = ("import sys, time; from ddp_notebook.engine import reservations\n"
            f"r, taken = reservations.reserve({uuids!r}); assert not taken, taken\n"
            "print('HELD', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + sys.path)))
    assert proc.stdout.readline().strip() == "HELD"
    return proc


# -- the lock folder -------------------------------------------------------------------------------

def test_a_symlink_planted_as_a_lock_file_is_not_followed_and_its_owner_is_named(other_user, shared_folder,
                                                                                 tmp_path):
    victim = tmp_path / "notes.txt"  # a private file of ours, and a path of ours where a file would run as code
    victim.write_text("mine")
    victim.chmod(0o600)
    startup = tmp_path / "startup.py"

    def plant():
        os.symlink(str(victim), _lock_path(shared_folder, GPU0))
        os.symlink(str(startup), _lock_path(shared_folder, GPU1))
    run_as(other_user, plant)

    held = reservations.holders([GPU0, GPU1])
    reservation, taken = reservations.reserve([GPU0, GPU1])
    assert reservation.uuids == [] and set(taken) == {GPU0, GPU1}
    with pytest.raises(LaunchError, match=rf"GPU 0 is reserved by {OTHER}'s symbolic link in place of the lock file "
                                          rf"{shared_folder}/{GPU0}\.lock"):
        job_spec.resolve_devices("0,")
    assert held[GPU0].user == OTHER and "symbolic link" in held[GPU0].what
    assert victim.read_text() == "mine" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not startup.exists()
    job_spec.resolve_devices("2,").release_devices()  # the other GPUs are untouched


def test_a_lock_file_unlinked_under_its_holder_does_not_let_a_second_job_take_the_gpu(other_user, shared_folder):
    def make_lock_file():
        fd = os.open(_lock_path(shared_folder, GPU0), os.O_CREAT | os.O_RDONLY, 0o666)
        os.fchmod(fd, 0o666)
        os.close(fd)
    run_as(other_user, make_lock_file)  # the other user made the lock file: they may unlink it
    first = _holder_process([GPU0])
    try:
        run_as(other_user, lambda: os.unlink(_lock_path(shared_folder, GPU0)))
        reservation, taken = reservations.reserve([GPU0])
        assert reservation.uuids == [] and taken[GPU0].pid == first.pid
        assert reservations.holders([GPU0])[GPU0].pid == first.pid
        with pytest.raises(LaunchError, match=rf"GPU 0 is reserved by \S+'s -c \(pid {first.pid}\)"):
            job_spec.resolve_devices("0,")
    finally:
        first.kill()
        first.wait(10)
    job_spec.resolve_devices("0,").release_devices()  # its holder gone, the GPU is free again


def test_a_fifo_ticket_or_lock_file_does_not_hang_and_is_named(other_user, shared_folder):
    older = "waiting-00000000000000000001-1-feed.lock"

    def plant():
        os.mkfifo(os.path.join(shared_folder, older), 0o666)
        os.mkfifo(_lock_path(shared_folder, GPU0), 0o666)
    run_as(other_user, plant)
    answers = []
    thread = threading.Thread(target=lambda: answers.append(_wait_line_turn()), daemon=True)
    thread.start()
    thread.join(60)  # a hang shows as a failure here rather than as a stuck test run
    assert answers == [True]
    assert stat.S_ISFIFO(os.lstat(os.path.join(shared_folder, older)).st_mode)  # another user's: left alone
    held = reservations.holders([GPU0])[GPU0]
    assert held.user == OTHER and held.what.startswith("FIFO in place of the lock file")


def _wait_line_turn() -> bool:
    with reservations.WaitingLine() as line:
        return line.my_turn()


def test_a_folder_made_first_by_another_user_is_refused_naming_its_owner(other_user, monkeypatch):
    parent = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    try:
        os.chmod(parent, 0o1777)
        squatted = os.path.join(parent, "ddp_notebook-gpus")
        for mode in (0o755, 0o1777):
            run_as(other_user, lambda: (os.mkdir(squatted), os.chmod(squatted, mode)))
            monkeypatch.setenv(reservations.DIR_ENV, squatted)
            with pytest.raises(LaunchError, match=rf"GPU reservations: the folder of GPU reservations is not "
                                                  rf"trusted: it is owned by {OTHER}, not by root or you \(root\)\. "
                                                  rf"Ask an administrator .*install -d -m 1777 {squatted}"):
                reservations.holders([GPU0])
            assert os.listdir(squatted) == []
            run_as(other_user, lambda: os.rmdir(squatted))
        link = os.path.join(parent, "link")
        run_as(other_user, lambda: os.symlink("/root", link))  # a folder of root's, reached through their link
        monkeypatch.setenv(reservations.DIR_ENV, link)
        with pytest.raises(LaunchError, match=rf"{link} is a symbolic link made by {OTHER}"):
            reservations.holders([GPU0])
        open_folder = os.path.join(parent, "open")
        os.mkdir(open_folder)
        os.chmod(open_folder, 0o777)  # root's, but anyone may replace its files
        monkeypatch.setenv(reservations.DIR_ENV, open_folder)
        with pytest.raises(LaunchError, match="other users may write in it and it is not sticky"):
            reservations.holders([GPU0])
    finally:
        shutil.rmtree(parent)


def test_an_administrator_s_folder_is_shared_by_both_users(other_user, shared_folder):
    def hold_gpu0():
        reservation, taken = reservations.reserve([GPU0])
        hold_gpu0.kept = reservation  # held until the child ends
        return reservation.uuids, taken

    with as_user(other_user, hold_gpu0) as (pid, (uuids, taken)):
        assert uuids == [GPU0] and taken == {}
        with pytest.raises(LaunchError, match=rf"GPU 0 is reserved by {OTHER}'s \S+ \(pid {pid}\)"):
            job_spec.resolve_devices("0,")
        mine = job_spec.resolve_devices("0,1", force=True)
        assert mine.reservation.uuids == [GPU1]
        lock = os.stat(_lock_path(shared_folder, GPU1))
        assert lock.st_uid == 0 and stat.S_IMODE(lock.st_mode) == 0o644  # the other user can open it to lock it
        assert run_as(other_user, lambda: reservations.holders([GPU1])[GPU1].pid) == os.getpid()
        mine.release_devices()
    assert reservations.holders([GPU0, GPU1]) == {GPU0: None, GPU1: None}
    ours = [n for n in os.listdir(shared_folder) if reservations.HELD_MARK in n
            and os.stat(os.path.join(shared_folder, n)).st_uid == os.geteuid()]
    assert ours == []  # released: its holder file removed (the other user's child ended without releasing)


# -- squatters ---------------------------------------------------------------------------------------

def test_a_gpu_or_a_place_in_line_held_forever_names_the_user(other_user, shared_folder):
    lock = _lock_path(shared_folder, GPU1)
    squatter = subprocess.Popen(["runuser", "-u", OTHER, "--", "flock", "--exclusive", lock, "-c",
                                 "echo LOCKED; exec sleep 600"], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        assert squatter.stdout.readline().strip() == "LOCKED"
        flock = next(p for p in psutil.Process(squatter.pid).children(recursive=True) if p.name() == "flock")
        with pytest.raises(LaunchError, match=rf"GPU 1 is reserved by {OTHER}'s flock \(pid {flock.pid}\) since "):
            job_spec.resolve_devices("1,")
    finally:
        os.killpg(squatter.pid, signal.SIGKILL)
        squatter.wait(10)

    def hold_an_old_ticket():
        import fcntl

        fd = os.open(os.path.join(shared_folder, "waiting-00000000000000000001-4242-feed.lock"),
                     os.O_CREAT | os.O_RDONLY, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        hold_an_old_ticket.kept = fd

    with as_user(other_user, hold_an_old_ticket):
        with pytest.raises(LaunchError, match=rf"did not become free within 0\.001 min .*ahead in line: "
                                              rf"{OTHER}'s place in the --wait line \(pid 4242\)"):
            job_spec.resolve_devices(1, wait=0.001)


# -- exports -------------------------------------------------------------------------------------------

def _exported_fn(x):
    return x + 1


def test_an_export_into_a_shared_folder_uses_no_file_another_user_put_there_and_warns(other_user, tmp_path):
    from ddp_notebook.engine import export as exporting

    shared = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    try:
        os.chmod(shared, 0o1777)
        victim = tmp_path / "victim.txt"
        victim.write_text("mine")
        victim.chmod(0o600)
        files = exporting.paths(os.path.join(shared, "train.py"))
        # The temp names an export used to write (fixed: ".tmp<pid>"), planted for this process.
        planted = [f"{files['payload']}.tmp{os.getpid()}", f"{files['manifest']}.tmp{os.getpid()}"]
        linked = os.path.join(shared, f"train.py.tmp{os.getpid()}")

        def plant():
            for path in planted:
                with open(path, "w") as f:
                    f.write("planted")
                os.chmod(path, 0o666)
            os.symlink(str(victim), linked)
        run_as(other_user, plant)

        with pytest.warns(exporting.ExportFolderWarning, match=rf"every user may write in {shared} \(mode 1777\): "
                                                               rf"another user could replace the export's files"):
            exported = exporting.export(_exported_fn, os.path.join(shared, "train.py"), args=(1,))
        payload_file = os.stat(exported.payload)
        assert payload_file.st_uid == os.geteuid() and stat.S_IMODE(payload_file.st_mode) == 0o600
        for path in (exported.manifest, exported.script):
            assert os.stat(path).st_uid == os.geteuid()
        with open(exported.payload, "rb") as f:
            assert pickle.load(f)["task"]  # the export's own payload
        for path in planted:
            st = os.lstat(path)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (other_user.uid, 0o666) and open(path).read() == "planted"
        assert os.readlink(linked) == str(victim)
        assert victim.read_text() == "mine" and stat.S_IMODE(victim.stat().st_mode) == 0o600
        names = {os.path.basename(p) for p in planted} | {os.path.basename(linked)}
        assert sorted(set(os.listdir(shared)) - names) == ["train.manifest.json", "train.payload.pkl", "train.py"]
    finally:
        shutil.rmtree(shared)


def test_an_export_into_a_folder_of_one_s_own_does_not_warn(tmp_path):
    import warnings

    from ddp_notebook.engine import export as exporting

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error", exporting.ExportFolderWarning)
        exported = exporting.export(_exported_fn, str(private / "train.py"), args=(1,))
    assert sorted(os.listdir(private)) == ["train.manifest.json", "train.payload.pkl", "train.py"]
    assert stat.S_IMODE(os.stat(exported.script).st_mode) == 0o755


# -- Slurm run files -------------------------------------------------------------------------------------

def _slurm_ranks(run_dir: str, key: bytes):
    """A Slurm backend of a 2-rank job 123 whose ranks may report through ``run_dir``, as after its submission;
    what it tells the job is collected."""
    from ddp_notebook.engine.runfiles import RunFiles
    from ddp_notebook.engine.slurm import SlurmRanks
    from ddp_notebook.engine.spec import JobSpec

    ranks = SlurmRanks(JobSpec(world_size=2, backend="gloo"), relay=None)
    told = []
    ranks.attach(lambda rank, kind, body: told.append((rank, kind, body)), lambda rank, code: told.append((rank, code)))
    ranks.job_id, ranks.run_dir, ranks.address = "123", run_dir, ("login", 4242)
    ranks._files = RunFiles(run_dir, key=key)
    return ranks, told


def _write_records(path: str, records: list[dict]) -> None:
    import json

    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_forged_slurm_run_files_are_ignored_and_said(tmp_path, capsys):
    import hashlib
    import secrets

    from ddp_notebook.wire import protocol

    key = secrets.token_bytes(32)
    run_dir = tmp_path / "123_ddp_notebook"
    run_dir.mkdir(mode=0o700)
    genuine, swapped = pickle.dumps("the rank's model"), pickle.dumps("someone else's object")
    (run_dir / "result-rank0.pkl").write_bytes(genuine)
    (run_dir / "result-rank1.pkl").write_bytes(swapped)
    head = {"run": "abc", "node": 0, "time": 1.0}
    metrics = str(run_dir / "metrics-node0.jsonl")
    _write_records(metrics, [
        protocol.signed_record({**head, "event": protocol.FILE_START, "world_size": 2}, key),
        protocol.signed_record({**head, "event": protocol.METRIC, "rank": 0, "key": "loss", "values": [1.0]}, key),
        {**head, "event": protocol.METRIC, "rank": 1, "key": "loss", "values": [666.0]},  # unsigned
        protocol.signed_record({**head, "event": protocol.FAILED, "rank": 1, "etype": "X", "message": "forged",
                                "traceback": "", "time": 1.0, "kind": "task"}, secrets.token_bytes(32)),
        protocol.signed_record({**head, "event": protocol.FILE_RESULT, "rank": 0, "file": "result-rank0.pkl",
                                "sha256": hashlib.sha256(genuine).hexdigest()}, key),
        protocol.signed_record({**head, "event": protocol.FILE_RESULT, "rank": 1, "file": "result-rank1.pkl",
                                "sha256": hashlib.sha256(genuine).hexdigest()}, key),  # its file was swapped
    ])
    ranks, told = _slurm_ranks(str(run_dir), key)
    ranks._read_files()
    assert ranks.mode == "files"
    kinds = [(rank, kind) for rank, kind, *_ in told if isinstance(kind, str)]
    assert kinds == [(-1, protocol.SCHEDULER), (0, protocol.METRIC), (0, protocol.RESULT)]
    assert told[-1][2]["value"] == genuine
    err = capsys.readouterr().err
    assert f"records in {metrics} not signed with this job's key were ignored" in err
    assert f"the result file {run_dir}/result-rank1.pkl is not the one its record names: not unpickled" in err


def test_slurm_run_files_are_not_read_once_the_ranks_use_the_channel(tmp_path):
    import secrets

    from ddp_notebook.wire import protocol

    key = secrets.token_bytes(32)
    run_dir = tmp_path / "123_ddp_notebook"
    run_dir.mkdir(mode=0o700)
    ranks, told = _slurm_ranks(str(run_dir), key)
    ranks.mode = "channel"  # a rank said READY over the channel
    # Even records signed with the job's key: no rank of a channel job writes them.
    _write_records(str(run_dir / "metrics-node0.jsonl"), [
        protocol.signed_record({"event": protocol.FILE_START, "world_size": 2}, key),
        protocol.signed_record({"event": protocol.FILE_EXIT, "rank": 0}, key)])
    ranks._read_files()
    assert told == [] and ranks.mode == "channel" and 0 not in ranks.exited


def test_a_slurm_run_folder_another_user_made_is_not_read(other_user, capsys):
    import secrets

    from ddp_notebook.wire import protocol

    key = secrets.token_bytes(32)
    job_folder = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    try:
        os.chmod(job_folder, 0o777)  # a job folder of a shared group (submitit's folder under umask 002, say)
        run_dir = os.path.join(job_folder, "123_ddp_notebook")

        def plant():
            os.mkdir(run_dir, 0o755)
            _write_records(os.path.join(run_dir, "metrics-node0.jsonl"),
                           [{"event": protocol.FILE_START, "world_size": 2}, {"event": protocol.FILE_EXIT, "rank": 0}])
        run_as(other_user, plant)
        ranks, told = _slurm_ranks(run_dir, key)
        ranks._read_files()
        assert told == [] and ranks.mode is None
        assert f"{run_dir} belongs to {OTHER}, not to you: its files are not read" in capsys.readouterr().err
    finally:
        shutil.rmtree(job_folder)


def test_a_rank_refuses_a_signed_run_folder_another_user_made(other_user):
    from ddp_notebook.rank import torchrun

    job_folder = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    try:
        os.chmod(job_folder, 0o1777)
        run_dir = os.path.join(job_folder, "123_ddp_notebook")
        run_as(other_user, lambda: os.mkdir(run_dir, 0o777))
        with pytest.raises(RuntimeError, match=rf"the run folder {run_dir} belongs to {OTHER}: the run's metrics and "
                                               rf"results go only into a folder of yours"):
            torchrun._run_folder(run_dir, strict=True)
        made = os.path.join(job_folder, "124_ddp_notebook")
        torchrun._run_folder(made, strict=True)
        assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    finally:
        shutil.rmtree(job_folder)


def _a_finished_run(run_dir: str) -> None:
    from ddp_notebook.wire import protocol

    head = {"run": "r1", "node": 0, "time": 1.0}
    _write_records(protocol.metrics_path(run_dir, 0),
                   [{**head, "event": "start", "world_size": 1, "nnodes": 1},
                    {**head, "event": "metric", "rank": 0, "key": "epoch", "x": 0, "values": {"loss": 1.0}},
                    {**head, "event": "exit", "rank": 0}, {**head, "event": "end", "ok": True}])


def test_follow_refuses_a_run_folder_another_user_owns_naming_them(other_user):
    import ddp_notebook

    parent = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    try:
        os.chmod(parent, 0o1777)
        run_dir = os.path.join(parent, "run")

        def plant():
            os.mkdir(run_dir, 0o755)
            _a_finished_run(run_dir)
        run_as(other_user, plant)
        with pytest.raises(PermissionError, match=rf"follow\(\): {run_dir} belongs to {OTHER}, not to you: its "
                                                  rf"files are not read"):
            ddp_notebook.follow(run_dir, wait=False)
    finally:
        shutil.rmtree(parent)


def test_follow_refuses_a_run_folder_of_one_s_own_that_others_may_write_in(tmp_path):
    import ddp_notebook

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _a_finished_run(str(run_dir))
    run_dir.chmod(0o777)
    with pytest.raises(PermissionError, match=rf"other users may write in {run_dir} \(mode 777\)"):
        ddp_notebook.follow(str(run_dir), wait=False)
    run_dir.chmod(0o755)
    run = ddp_notebook.follow(str(run_dir), wait=False)
    assert (run.status, run.history) == ("done", [{"epoch": 0, "loss": 1.0}])


def test_the_picker_shows_a_refused_reservations_folder_instead_of_raising(other_user, shared_folder, monkeypatch):
    squatted = os.path.join(shared_folder, "theirs")
    run_as(other_user, lambda: os.mkdir(squatted, 0o1777))
    monkeypatch.setenv(reservations.DIR_ENV, squatted)
    panel = picker.gpu_picker()
    try:
        assert sorted(panel.checkboxes) == list(range(8))  # the GPUs are listed all the same
        assert f"not trusted: it is owned by {OTHER}, not by root or you (root)" in panel.header.value
        assert "ddp-picker-refused" in panel.header.value
        with pytest.raises(LaunchError, match=f"it is owned by {OTHER}"):  # and a launch still refuses it
            reservations.holders([GPU0])
    finally:
        panel.close()
