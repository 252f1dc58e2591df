"""Rank output: prefixed, batched, paced, elided with a count, and the tail always shown."""
import io
import re

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


class Recorder:
    """The two streams of a cell: every write, in order, as (stream, text)."""

    def __init__(self):
        self.writes = []
        self.out, self.err = self._stream("stdout"), self._stream("stderr")

    def _stream(self, name):
        recorder = self

        class Stream(io.StringIO):
            def write(self, text):
                recorder.writes.append((name, text))
                return len(text)

        return Stream()

    def shown(self):
        """What a Jupyter front end shows: consecutive writes to one stream are one output, in which "\r" goes back
        to the start of the line and overwrites it (JupyterLab's and Notebook's rule, as a terminal's)."""
        blocks = []
        for name, text in self.writes:
            if blocks and blocks[-1][0] == name:
                blocks[-1][1] += text
            else:
                blocks.append([name, text])
        return [(name, _render(text)) for name, text in blocks]


def _render(text):
    lines = []
    for line in re.sub(r"\r+\n", "\n", text).split("\n"):
        shown = ""
        for segment in line.split("\r"):
            shown = segment + shown[len(segment):]
        lines.append(shown.rstrip())
    return "\n".join(lines)


def test_a_redrawn_line_shows_at_each_flush_and_its_end_overwrites_it():
    cell = Recorder()
    relay = OutputRelay(cell.out, cell.err)
    relay.feed(0, "stdout", b"before\n")
    relay.feed(0, "stderr", b"\r  0%|    | 0/3")
    relay.flush()
    relay.feed(0, "stderr", b"\r 33%|#   | 1/3")
    relay.feed(0, "stderr", b"\r 66%|##  | 2/3")  # only the newest drawing of a flush goes out
    relay.flush()
    relay.flush()  # unchanged: nothing written
    relay.feed(0, "stderr", b"\r100%|###| 3/3\n")
    relay.feed(0, "stdout", b"after\n")
    relay.flush(final=True)
    assert cell.writes == [
        ("stdout", "[rank 0] before\n"),
        ("stderr", "[rank 0]   0%|    | 0/3"),
        ("stderr", "\r[rank 0]  66%|##  | 2/3"),
        ("stderr", "\r[rank 0] 100%|###| 3/3 \n"),  # padded to cover the longer line it overwrites
        ("stdout", "[rank 0] after\n"),
    ]
    assert cell.shown() == [("stdout", "[rank 0] before\n"), ("stderr", "[rank 0] 100%|###| 3/3\n"),
                            ("stdout", "[rank 0] after\n")]


def test_lines_of_stdout_and_stderr_keep_the_order_they_came_in():
    cell = Recorder()
    relay = OutputRelay(cell.out, cell.err)
    relay.feed(0, "stdout", b"one\n")
    relay.feed(0, "stderr", b"two\n")
    relay.feed(0, "stdout", b"three\n")
    relay.flush()
    assert cell.writes == [("stdout", "[rank 0] one\n"), ("stderr", "[rank 0] two\n"),
                           ("stdout", "[rank 0] three\n")]


def test_other_lines_go_above_the_redrawn_line_and_it_is_drawn_again_below_them():
    cell = Recorder()
    relay = OutputRelay(cell.out, cell.err)
    relay.feed(0, "stderr", b"\r 10%|#         | 1/10")
    relay.flush()
    relay.feed(1, "stderr", b"warning\n")
    relay.flush()
    assert cell.shown() == [("stderr", "[rank 1] warning\n[rank 0]  10%|#         | 1/10")]
    relay.feed(0, "stdout", b"a print inside the loop\n")
    relay.feed(0, "stderr", b"\r 20%|##        | 2/10")
    relay.flush()
    assert cell.shown()[1:] == [("stdout", "[rank 0] a print inside the loop\n"),
                                ("stderr", "[rank 0]  20%|##        | 2/10")]


def test_a_bar_that_clears_its_line_leaves_nothing_and_the_next_line_starts_clean():
    cell = Recorder()
    relay = OutputRelay(cell.out, cell.err)
    relay.feed(0, "stderr", b"\r 50%|#####     | 5/10")
    relay.flush()
    relay.feed(0, "stderr", b"\r" + b" " * 20 + b"\r")  # tqdm(leave=False) closing
    relay.flush()
    relay.feed(0, "stderr", b"next\n")
    relay.flush(final=True)
    assert cell.shown() == [("stderr", "[rank 0] next\n")]


def test_a_line_ended_without_a_redraw_waits_for_its_end():
    cell = Recorder()
    relay = OutputRelay(cell.out, cell.err)
    relay.feed(0, "stdout", b"loading ")
    relay.flush()
    relay.feed(0, "stdout", b"done\n")
    relay.flush()
    assert cell.writes == [("stdout", "[rank 0] loading done\n")]


def test_a_background_jobs_log_shows_a_redrawn_line_once(monkeypatch):
    from ddp_notebook.notebook import cell_output

    shown = []

    class Output:
        def __init__(self, data):
            shown.append(data["text/plain"])

        def update(self, data):
            shown.append(data["text/plain"])

    monkeypatch.setattr(cell_output, "CellOutput", Output)
    log = cell_output.CellLog()
    relay = OutputRelay(log, log)
    relay.feed(0, "stdout", b"before\n")
    for i in range(3):
        relay.feed(0, "stderr", b"\r%d/3" % i)
        relay.flush()
    assert shown[-1] == "[rank 0] before\n[rank 0] 2/3"
    relay.feed(0, "stderr", b"\r3/3\n")
    relay.feed(0, "stdout", b"after\n")
    relay.flush(final=True)
    assert shown[-1].splitlines() == ["[rank 0] before", "[rank 0] 3/3", "[rank 0] after"]


WRITES_BOTH_STREAMS = """
import sys
from ddp_notebook.rank import streams
streams.WAIT_S = 120  # (here: however slowly the test reads)
streams.keep_in_order()
for i in range(10):
    print("out", i)
    print("err", i, file=sys.stderr)
"""


def test_a_ranks_stdout_and_stderr_are_read_in_the_order_it_wrote_them():
    import os
    import select
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", WRITES_BOTH_STREAMS], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    read, open_pipes = [], {child.stdout.fileno(): "", child.stderr.fileno(): ""}  # (what a line has so far)
    try:
        while open_pipes:
            time.sleep(0.01)  # a busy notebook: both pipes would have something by the time it looks
            ready, _, _ = select.select(sorted(open_pipes), [], [])
            for fd in sorted(ready):  # stdout first, as its lower descriptor
                data = os.read(fd, 1 << 16)
                if data:
                    *lines, open_pipes[fd] = (open_pipes[fd] + data.decode()).split("\n")
                    read += lines
                else:
                    del open_pipes[fd]
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()
    assert read == [f"{name} {i}" for i in range(10) for name in ("out", "err")]


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


BAR_CELL = """\
%%ddp --cpus 2 --output 0
import time
{imports}
print("before")
for i in tqdm(range(30)):
    time.sleep(0.1)
print("after")
"""


@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.parametrize("imports, notebook_imports", [
    ("from tqdm import tqdm", ""),
    ("from tqdm.auto import tqdm", ""),
    ("", "from tqdm.auto import tqdm"),  # the notebook's bar class, sent to the ranks
    ("", "from tqdm.notebook import tqdm"),  # a widget bar in the notebook: a text bar in a rank
])
def test_a_tqdm_bar_in_a_rank_is_redrawn_while_it_runs_between_its_prints(imports, notebook_imports, no_leftovers):
    from nbrun import kernel

    with kernel() as (_km, kc):
        if notebook_imports:
            kc.execute_interactive(notebook_imports, timeout=60)
        streams = []
        reply = kc.execute_interactive(BAR_CELL.format(imports=imports), timeout=120, output_hook=lambda msg: (
            streams.append((msg["content"]["name"], msg["content"]["text"])) if msg["msg_type"] == "stream" else None))
    assert reply["content"]["status"] == "ok"
    assert streams[0] == ("stdout", "[rank 0] before\n") and streams[-1] == ("stdout", "[rank 0] after\n")
    bar = streams[1:-1]
    assert {name for name, _ in bar} == {"stderr"}
    counts = [int(re.search(r"(\d+)/30", text).group(1)) for _, text in bar]
    # Each message one redraw, sent as the bar moved (a 3 s bar, five flushes a second), in order, each overwriting
    # the one before; the last one ends the line (tqdm's close draws 30/30 once more).
    assert len(set(counts)) >= 5 and counts == sorted(counts) and counts[-1] == 30
    assert all(text.startswith("\r[rank 0] ") for _, text in bar[1:]) and bar[-1][1].endswith("\n")
    assert _render("".join(text for _, text in bar)) == bar[-1][1].strip("\r\n").rstrip() + "\n"
