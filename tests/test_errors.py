"""Which failure is the cause: the classification and blame rules, without processes."""
from ddp_notebook.wire.errors import Failure, blame, classify, nccl_watchdog_timeout


class DistBackendError(RuntimeError):  # the name torch.distributed gives its backend errors
    pass


def test_only_torch_distributed_errors_count_as_lost_peers_or_timeouts():
    assert classify(TimeoutError("download of the dataset timed out")) == "user"
    assert classify(ConnectionRefusedError("the tracking server refused")) == "user"
    assert classify(BrokenPipeError("a pipe of my own")) == "user"
    assert classify(ValueError("bad value")) == "user"
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/"
    assert classify(RuntimeError(gloo + "pair.cc:534] Connection closed by peer [127.0.0.1]:5")) == "comm"
    assert classify(RuntimeError(gloo + "unbound_buffer.cc:78] Timed out waiting 3000ms for recv")) == "timeout"
    assert classify(DistBackendError("NCCL communicator was aborted on rank 1")) == "comm"
    assert classify(DistBackendError("Watchdog caught collective operation timeout")) == "timeout"


def test_blame_prefers_real_errors_then_the_earliest_on_the_ranks_clocks():
    lost_peer = Failure(0, "RuntimeError", "Connection closed by peer", "", time=1.0, kind="comm")
    real = Failure(1, "ValueError", "boom", "", time=2.0, kind="user")  # reported later, still the cause
    assert blame([lost_peer, real]) is real
    earlier = Failure(2, "KeyError", "k", "", time=1.5, kind="user")
    assert blame([lost_peer, real, earlier]) is earlier
    died = Failure(3, "RankDied", "killed by SIGKILL", "", time=5.0, kind="exit")
    assert blame([lost_peer, died]) is died
    interrupted = Failure(0, "KeyboardInterrupt", "", "", time=0.5, kind="interrupted")
    assert blame([interrupted, lost_peer]) is lost_peer


def test_only_the_nccl_watchdog_s_own_line_marks_an_abort_as_a_timeout():
    # (The real path, a rank aborted after that line, is tests/test_core_launch.py's watchdog test.)
    assert nccl_watchdog_timeout("") is None
    assert nccl_watchdog_timeout("Timeout(ms)=3000\nsome collective timed out\nAborted (core dumped)\n") is None
    line = "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2) ran for 9 milliseconds " \
           "before timing out."
    assert nccl_watchdog_timeout(f"[rank3]:[E1130 ProcessGroupNCCL.cpp:632] {line}\nAborted\n") == line
