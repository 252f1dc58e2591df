"""Rank output: prefixed, batched, paced, elided with a count, and the tail always shown."""
import io

import pytest

import ddp_notebook
from ddp_notebook.engine import spec as job_spec
from ddp_notebook.engine import job as engine_job
from ddp_notebook.engine.output import OutputRelay

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_relay_prefixes_batches_and_elides_the_oldest_lines():
    out, err, clock = io.StringIO(), io.StringIO(), Clock()
    relay = OutputRelay(out, err, interval=0.2, bytes_per_second=1000, clock=clock)
    relay.feed(1, "stdout", b"hello\npart")
    relay.feed(0, "stderr", b"warn\n")
    relay.maybe_flush()
    assert out.getvalue() == ""  # paced: nothing before the interval
    clock.now = 0.25
    relay.maybe_flush()
    assert out.getvalue() == "[rank 1] hello\n" and err.getvalue() == "[rank 0] warn\n"
    relay.feed(1, "stdout", b"ial\n" + b"".join(b"line %d\n" % i for i in range(1000)))
    relay.flush()
    shown = out.getvalue().splitlines()
    assert shown[-1] == "[rank 1] line 999"
    assert "lines of rank 1 elided" in shown[1] and relay.elided > 900
    assert sum(len(s) + 1 for s in shown[2:]) <= 200 + 20  # within one interval's byte budget
    relay.feed(0, "stdout", b"no newline at the end")
    relay.flush(final=True)
    assert out.getvalue().endswith("[rank 0] no newline at the end\n")


def test_a_progress_bar_redrawn_with_carriage_returns_keeps_only_what_a_terminal_shows():
    out = io.StringIO()
    relay = OutputRelay(out, io.StringIO())
    for i in range(20_000):
        relay.feed(0, "stdout", b"\r%5d/20000 |####" % i)
    assert sum(len(v) for v in relay._partial.values()) < 100  # never grows with the redraws
    relay.feed(0, "stdout", b"\rdone\n")
    relay.flush(final=True)
    assert out.getvalue() == "[rank 0] done\n"


def _leaves_a_child_holding_stdout():
    import subprocess

    return subprocess.Popen(["sleep", "60"]).pid  # inherits the rank's stdout and stderr


@pytest.mark.slow
def test_a_child_that_outlives_its_rank_neither_hangs_the_job_nor_survives_it(no_leftovers):
    import time

    import psutil

    started = time.time()
    pids = ddp_notebook.launch(_leaves_a_child_holding_stdout, cpus=2)
    assert time.time() - started < 30
    deadline = time.time() + 5
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids) \
            and time.time() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_output_filter_keeps_rank_0_only():
    out = io.StringIO()
    relay = OutputRelay(out, io.StringIO(), ranks={0})
    relay.feed(0, "stdout", b"a\n")
    relay.feed(1, "stdout", b"b\n")
    relay.flush(final=True)
    assert out.getvalue() == "[rank 0] a\n"


def _flood():
    for i in range(100_000):
        print("flood line", i)
    return "done"


@pytest.mark.slow
def test_a_flooding_rank_completes_and_shows_its_last_line(no_leftovers):
    out = io.StringIO()
    spec = job_spec.resolve_devices(cpus=2)
    job = engine_job.Job(spec, ddp_notebook.wire.payload.dumps(ddp_notebook.wire.payload.CallTask(_flood, (), {}, False,
                                                                                     ddp_notebook.wire.payload.Sources())),
                       relay=OutputRelay(out, io.StringIO()))
    assert job.start().result() == ["done", "done"]
    shown = out.getvalue()
    assert "[rank 0] flood line 99999" in shown and "[rank 1] flood line 99999" in shown
    assert "lines of rank 0 elided" in shown
    assert len(shown) < 2_000_000  # 200,000 lines (~5 MB) were paced down
