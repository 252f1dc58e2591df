"""Another user of the machine, not trusted: ``--log-dir`` and ``follow()`` in a folder they may write in (issue 36).

The attacker is a real second Unix user (``other_user``, from test_security_files); the shared folder is a
group project folder as people keep them: 0777 and not sticky, in /tmp (which both users can reach; the tests'
own TMPDIR is private).  What the victim (these tests, root) chose for a log that is not a plain file of theirs:
the job is refused before any rank starts, naming the file and its owner; a log refused once the job runs (a
rank whose log was not opened before) is not written, and said once.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tempfile
import warnings

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ddp_notebook
from ddp_notebook.engine import output
from ddp_notebook.engine.runfiles import RunFiles
from ddp_notebook.notebook.following import FollowedRun
from ddp_notebook.wire import safe_files, protocol
from ddp_notebook.wire.errors import LaunchError
from test_security_files import OTHER, other_user, run_as  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(120)  # a FIFO opened for writing would hang here, not pass


@pytest.fixture
def shared():
    """A group project folder: 0777, not sticky (anyone may remove or rename what is in it)."""
    path = tempfile.mkdtemp(prefix="ddpnb-sec-", dir="/tmp")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def victim_file(tmp_path):
    """A private file of the victim's, in a folder the attacker cannot enter (a link to it needs only its path)."""
    path = tmp_path / "private.txt"
    path.write_text("the victim's own\n")
    path.chmod(0o600)
    return path


def _writes_a_marker(marker):
    open(marker, "w").close()
    print("rank output")
    return 1


def _launch_refused(log_dir, marker):
    with pytest.warns(output.LogFolderWarning):
        with pytest.raises(LaunchError) as refused:
            ddp_notebook.launch(_writes_a_marker, (str(marker),), cpus=2, log_dir=log_dir)
    assert not marker.exists()  # no rank was started
    return str(refused.value)


def test_a_link_planted_as_rank0_log_refuses_the_job_naming_its_owner_and_leaves_the_target(
        other_user, shared, victim_file, tmp_path, no_leftovers):
    log = os.path.join(shared, "rank0.log")
    run_as(other_user, lambda: os.symlink(str(victim_file), log))
    message = _launch_refused(shared, tmp_path / "ran")
    assert message == (f"--log-dir {shared}: {log} is a symbolic link of {OTHER}'s, not a plain file of yours: not "
                       f"opened; no rank was started (remove it, or log into a folder only you can write in)")
    assert victim_file.read_text() == "the victim's own\n" and stat.S_IMODE(victim_file.stat().st_mode) == 0o600
    assert os.readlink(log) == str(victim_file) and os.listdir(shared) == ["rank0.log"]


def test_a_fifo_planted_as_rank0_log_does_not_hang_the_job_and_is_named(other_user, shared, tmp_path,
                                                                         no_leftovers):
    log = os.path.join(shared, "rank0.log")
    run_as(other_user, lambda: os.mkfifo(log, 0o666))
    message = _launch_refused(shared, tmp_path / "ran")
    assert f"{log} is a FIFO of {OTHER}'s, not a plain file of yours: not opened; no rank was started" in message


def test_another_user_s_file_as_rank1_log_is_not_appended_to(other_user, shared, tmp_path, no_leftovers):
    log = os.path.join(shared, "rank1.log")

    def plant():
        with open(log, "w") as f:
            f.write("theirs\n")
        os.chmod(log, 0o666)  # even one anyone may write: the victim's output is not handed to them
    run_as(other_user, plant)
    message = _launch_refused(shared, tmp_path / "ran")
    assert f"{log} is a file of {OTHER}'s, not a plain file of yours" in message
    assert open(log).read() == "theirs\n"


def test_a_hard_link_as_a_rank_log_is_not_written(tmp_path, victim_file, no_leftovers):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    os.link(victim_file, logs / "rank0.log")  # (another user cannot link a file of yours: protected_hardlinks)
    with pytest.raises(LaunchError, match=r"rank0.log is a file of yours with 1 other name\(s\) \(a hard link"):
        ddp_notebook.launch(_writes_a_marker, (str(tmp_path / "ran"),), cpus=2, log_dir=str(logs))
    assert victim_file.read_text() == "the victim's own\n"


def test_rank_logs_are_made_0600_whatever_the_umask_and_a_private_folder_does_not_warn(tmp_path, no_leftovers):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    umask = os.umask(0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", safe_files.SharedFolderWarning)
            assert ddp_notebook.launch(_writes_a_marker, (str(tmp_path / "ran"),), cpus=2,
                                       log_dir=str(logs)) == [1, 1]
    finally:
        os.umask(umask)
    for rank in (0, 1):
        st_log = os.lstat(logs / f"rank{rank}.log")
        assert stat.S_ISREG(st_log.st_mode) and stat.S_IMODE(st_log.st_mode) == 0o600
        assert st_log.st_uid == os.geteuid() and (logs / f"rank{rank}.log").read_text() == "rank output\n"


def test_a_log_folder_others_may_write_in_warns_and_the_logs_are_written_safely(shared, tmp_path, no_leftovers):
    with pytest.warns(output.LogFolderWarning, match=rf"every user may write in {shared} \(mode 777\): another "
                                                     rf"user could remove the rank logs"):
        assert ddp_notebook.launch(_writes_a_marker, (str(tmp_path / "ran"),), cpus=2, log_dir=shared) == [1, 1]
    assert sorted(os.listdir(shared)) == ["rank0.log", "rank1.log"]
    assert all(stat.S_IMODE(os.stat(os.path.join(shared, n)).st_mode) == 0o600 for n in os.listdir(shared))


def test_a_log_folder_another_user_owns_warns_naming_them(other_user, shared):
    theirs = os.path.join(shared, "theirs")
    run_as(other_user, lambda: os.mkdir(theirs, 0o755))
    with pytest.warns(output.LogFolderWarning, match=rf"its owner {OTHER} may write in {theirs} \(mode 755\)"):
        logs = output.RankLogs.open(theirs, [0])
    logs.close()


def test_a_link_planted_after_the_job_started_is_not_written_through_and_is_said_once(other_user, shared,
                                                                                      victim_file):
    err = io.StringIO()
    relay = output.OutputRelay(io.StringIO(), err)
    with pytest.warns(output.LogFolderWarning):
        relay.logs = output.RankLogs.open(shared, [0])  # rank 1's log is first opened when it prints
    run_as(other_user, lambda: os.symlink(str(victim_file), os.path.join(shared, "rank1.log")))
    for rank in (0, 1, 1):
        relay.feed(rank, "stdout", f"line of rank {rank}\n".encode())
    relay.add_to_log(1, "[ddp_notebook] rank 1's error:\nboom\n")  # a rank's error report takes the same way
    relay.close_logs()
    assert victim_file.read_text() == "the victim's own\n"
    assert open(os.path.join(shared, "rank0.log")).read() == "line of rank 0\n"
    assert err.getvalue() == (f"[ddp_notebook] {shared}/rank1.log is a symbolic link of {OTHER}'s, not a plain "
                              f"file of yours: not opened; rank 1's output is not logged there\n")
    assert "line of rank 1" in relay.log(1) and "boom" in relay.log(1)  # job.logs(1) still has it


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.tuples(st.integers(-1, 3), st.binary(max_size=3000)), max_size=30))
def test_each_rank_log_holds_exactly_the_bytes_its_rank_wrote(tmp_path, chunks):
    folder = tempfile.mkdtemp(dir=tmp_path)
    relay = output.OutputRelay(io.StringIO(), io.StringIO())
    relay.logs = output.RankLogs.open(folder, [0])
    for rank, data in chunks:
        relay.feed(rank, "stdout", data)
    relay.close_logs()
    ranks = {0} | {rank for rank, _ in chunks}
    assert sorted(os.listdir(folder)) == sorted(f"rank{rank}.log" for rank in ranks)
    for rank in ranks:
        with open(os.path.join(folder, f"rank{rank}.log"), "rb") as f:
            assert f.read() == b"".join(data for r, data in chunks if r == rank)


# -- follow() ------------------------------------------------------------------------------------------------------

def _records(path: str, records: list[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _metric(loss: float, x: int) -> dict:
    return {"run": "r1", "node": 0, "time": 1.0, "event": "metric", "rank": 0, "key": "epoch", "x": x,
            "values": {"loss": loss}}


START = {"run": "r1", "node": 0, "time": 1.0, "event": "start", "world_size": 1, "nnodes": 1}


def test_a_run_folder_swapped_for_a_link_between_polls_is_not_followed(other_user, shared):
    run_dir = os.path.join(shared, "run")
    os.mkdir(run_dir, 0o755)
    _records(protocol.metrics_path(run_dir, 0), [START, _metric(1.0, 0)])
    run = FollowedRun(run_dir)
    assert run.poll() == 2  # the folder is open from now on

    moved = os.path.join(shared, "moved")
    forged = os.path.join(shared, "forged")

    def swap():  # the folder is not sticky: anyone may rename the victim's run folder away
        os.rename(run_dir, moved)
        os.mkdir(forged, 0o755)
        _records(os.path.join(forged, "metrics-node0.jsonl"), [START, _metric(666.0, 1)])
        os.symlink(forged, run_dir)
    run_as(other_user, swap)
    _records(protocol.metrics_path(moved, 0), [_metric(0.5, 1)])  # the run goes on in its own folder
    assert run.poll() == 1
    run.close_files()
    assert [r["loss"] for r in run.history] == [1.0, 0.5]
    with pytest.raises(PermissionError, match=rf"follow\(\): {run_dir} is a symbolic link of {OTHER}'s, not a "
                                              rf"folder: its files are not read"):
        ddp_notebook.follow(run_dir, wait=False)


def test_run_files_replaced_by_links_or_fifos_between_polls_are_not_read(tmp_path, victim_file, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    metrics = protocol.metrics_path(str(run_dir), 0)
    _records(metrics, [START, _metric(1.0, 0)])
    run = FollowedRun(str(run_dir))
    assert run.poll() == 2
    elsewhere = tmp_path / "elsewhere.jsonl"
    _records(str(elsewhere), [START, _metric(1.0, 0), _metric(666.0, 1)])
    os.unlink(metrics)
    os.symlink(elsewhere, metrics)
    os.mkfifo(protocol.metrics_path(str(run_dir), 1))
    assert run.poll() == 0 and run.poll() == 0
    run.close_files()
    assert [r["loss"] for r in run.history] == [1.0]
    err = capsys.readouterr().err
    assert err.count(f"ddp_notebook: follow(): {metrics} is a symbolic link of yours, not a plain file of yours: "
                     f"not opened\n") == 1
    assert f"{run_dir}/metrics-node1.jsonl is a FIFO of yours, not a plain file of yours" in err


def test_a_result_file_replaced_by_a_link_is_not_read(tmp_path, victim_file):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    os.symlink(victim_file, run_dir / "result-rank0.pkl")
    files = RunFiles(str(run_dir))
    assert files.result({"file": "result-rank0.pkl"}) is None
    files.close()
    assert files.problems == [f"the result file {run_dir}/result-rank0.pkl is a symbolic link of yours, not a plain "
                              f"file of yours: not opened"]
