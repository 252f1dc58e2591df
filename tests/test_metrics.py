"""report()/progress() on the rank side, and the notebook side (watcher, text view, callbacks, figure)
driven with events, without processes (but one: a job of the engine alone keeps its metrics)."""
import io
import json
import math
import os
import pickle
import random
import re
import subprocess
import sys
import threading
import time
import types
import warnings

import numpy as np
import pytest

from ddp_notebook.rank import context
from ddp_notebook.notebook import dashboard
from ddp_notebook.rank import metrics, timing
from ddp_notebook.engine import history
from ddp_notebook.engine.callbacks import Forwarder, TensorBoard, WandB, resolve
from ddp_notebook.engine.metrics import Metrics
from ddp_notebook.engine.spec import JobSpec
from ddp_notebook.wire import protocol

pytestmark = pytest.mark.timeout(30)


class FakeSender:
    """Records what a rank sends, as the notebook would receive it (pickled on the way)."""

    broken = False

    def __init__(self):
        self.queued = []

    def send(self, kind, body=None):
        self.queued.append((kind, body))

    @property
    def sent(self):
        return [(kind, pickle.loads(pickle.dumps(body))) for kind, body in self.queued]


@pytest.fixture
def in_rank():
    sender = FakeSender()
    timing.reset()  # batches timed by other tests in this process are not this rank's
    metrics.begin_task()  # (as a rank does at each task's start)
    context.set_current(context.RankContext(rank=1, local_rank=1, world_size=2, local_world_size=2, sender=sender))
    yield sender
    context.set_current(None)
    metrics.begin_task()  # (a batch this test left queued is not the next test's)


def test_report_outside_a_job_prints_one_line():
    code = ("from ddp_notebook import report, progress\n"
            "report(epoch=3, epochs=10, train_loss=0.41234, val_acc=0.9)\n"
            "progress(1, 10)\n"
            "import sys\n"
            "print(sorted(m for m in ('IPython', 'ipywidgets', 'matplotlib', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.stdout.splitlines() == ["epoch 3/10  train_loss 0.4123  val_acc 0.9", "[]"]
    assert out.stderr == ""


def test_report_in_a_rank_sends_one_event(in_rank):
    metrics.report(epoch=2, epochs=5, n=32, loss=np.float32(0.5), samples=metrics.Sum(64), correct=True)
    report = {"key": "epoch", "x": 2, "total": 5, "n": 32, "sum": ["samples"],
              "values": {"loss": 0.5, "samples": 64, "correct": 1.0}}
    assert in_rank.sent == [("metric", {"reports": [report]})]


def test_a_ranks_timings_ride_once_a_batch_of_reports_read_off_the_loop_and_the_reports_stay_a_run(in_rank,
                                                                                                   monkeypatch):
    import psutil

    reads = []

    class Counted(psutil.Process):
        def memory_info(self):
            reads.append(1)
            return super().memory_info()

    monkeypatch.setattr(psutil, "Process", Counted)
    for step in range(200):  # a loader's timed batches, report() every step
        timing.batch_done(data_s=0.001, step_s=0.002, samples=8)
        metrics.report(step=step, steps=200, loss=float(step))
    assert reads == []  # nothing read in the training loop (a /proc read costs 30-90 µs)
    assert len(in_rank.queued) == 1
    (kind, body), = in_rank.sent  # the sender seals the batch: the timings are read then, once
    assert reads == [1]
    assert body["reports"] == [(protocol.RUN, "step", 200, ("loss",), list(range(200)),
                                [[float(step) for step in range(200)]])]  # alike reports: one run, not 200 dicts
    stats = body["rank_stats"]
    assert (stats["batches"], stats["samples"], stats["memory_kind"]) == (200, 1600, "resident") and stats["memory"] > 0
    assert stats["step_s"] == pytest.approx(0.4) and stats["data_s"] == pytest.approx(0.2)
    metrics.report(step=200, loss=0.0)  # no batch timed since: the next batch carries no timings
    assert "rank_stats" not in in_rank.sent[1][1]


def test_the_engine_keeps_each_ranks_timings_from_the_batches_of_reports():
    metrics_of_run = Metrics(2)
    for rank, comm_s in ((0, 0.5), (1, 0.0)):
        for _ in range(2):
            metrics_of_run(None, protocol.METRIC, rank, {"reports": [{"key": "step", "x": 1, "values": {"loss": 1.0}}],
                                                        "rank_stats": {"batches": 10, "samples": 80, "step_s": 1.0,
                                                                       "data_s": 0.1, "comm_s": comm_s,
                                                                       "memory": 2**20, "memory_kind": "resident"}})
    assert metrics_of_run.ranks[0] == {"batches": 20, "samples_per_s": 80.0, "data_wait": pytest.approx(0.1),
                                       "comm_wait": pytest.approx(0.5), "compute": pytest.approx(0.4),
                                       "memory": 2**20, "memory_kind": "resident"}
    assert metrics_of_run.ranks.straggler()[0] == 1  # rank 0 waits half of each step for rank 1


def test_reports_waiting_for_the_sender_travel_together(in_rank):
    metrics.report(epoch=1, loss=1.0)
    metrics.report(epoch=2, loss=2.0)  # the sender has not taken the first event yet: same message
    assert len(in_rank.queued) == 1
    # Pickling (sending) seals the batch; alike reports go as one run: key, total, names, x values, a column each.
    assert in_rank.sent[0][1]["reports"] == [(protocol.RUN, "epoch", None, ("loss",), [1, 2], [[1.0, 2.0]])]
    metrics.report(epoch=3, loss=3.0)
    assert len(in_rank.queued) == 2
    assert in_rank.sent[1][1]["reports"] == [{"key": "epoch", "x": 3, "values": {"loss": 3.0}}]  # (one: a record)
    assert [r["x"] for batch in in_rank.sent for r in protocol.expand_reports(batch[1]["reports"])] == [1, 2, 3]


def test_report_steps_and_implicit_steps(in_rank):
    metrics.report(step=10, epoch=1, loss=1.0)
    metrics.report(loss=2.0)
    bodies = in_rank.sent[0][1]["reports"]
    assert (bodies[0]["key"], bodies[0]["x"], bodies[0]["epoch"]) == ("step", 10, 1)
    assert (bodies[1]["key"], bodies[1]["x"]) == ("step", 11)


def test_a_step_that_goes_back_starts_a_new_pass_counted_on_and_each_task_starts_afresh(in_rank):
    for epoch in range(3):
        for i in range(1, 4):  # steps counted within each epoch, from 1
            metrics.report(epoch=epoch, step=i, steps=3, loss=float(10 * epoch + i))
        metrics.report(epoch=epoch, val_loss=float(epoch))  # (another key: its own axis)
        metrics.report(epoch=epoch, val_acc=0.5)  # the same x again: not a new pass
    reports = [r for _, body in in_rank.sent for r in protocol.expand_reports(body["reports"])]
    steps = [r for r in reports if r["key"] == "step"]
    assert [(r["x"], r["total"], r["epoch"], r["values"]["loss"]) for r in steps] == [
        (3 * epoch + i, 3 * (epoch + 1), epoch, 10.0 * epoch + i) for epoch in range(3) for i in range(1, 4)]
    assert [r.get("went_back") for r in steps] == [None] * 3 + [(3, 1), None, None] * 2  # (the user's x values)
    epochs = [(r["x"], r.get("went_back")) for r in reports if r["key"] == "epoch"]
    assert epochs == [(0, None), (0, None), (1, None), (1, None), (2, None), (2, None)]
    metrics.report(loss=1.0)  # no step: the next one, counted on as the user's steps are
    assert [(r["x"], r.get("went_back")) for r in protocol.expand_reports(in_rank.sent[-1][1]["reports"])][-1] == \
        (10, None)

    metrics.begin_task()  # a warm pool's next cell: its steps start afresh
    in_rank.queued.clear()
    for step in (0, 1, 2, 3, 1, 4, 0, 1):  # no epoch given: back at the first step is a new pass; a validation
        metrics.report(step=step, loss=float(step))  # reported at an earlier step is not
    metrics.report(loss=9.0)
    sent = [(r["x"], r.get("went_back")) for _, body in in_rank.sent for r in protocol.expand_reports(body["reports"])]
    assert sent == [(0, None), (1, None), (2, None), (3, None), (1, None), (4, None), (5, (4, 0)), (6, None),
                    (7, None)]


def _epochs_of_steps_counted_within_each():
    import time

    from ddp_notebook import rank_context, report

    rank = rank_context().rank
    for epoch in range(3):
        for i in range(4):
            report(epoch=epoch, step=i, steps=4, loss=float(100 * rank + 10 * epoch + i))
            time.sleep(0.02)  # (the ranks' batches of reports interleave)


def test_steps_counted_within_each_epoch_keep_every_epochs_records_and_the_cell_is_told_once(capfd, no_leftovers):
    import ddp_notebook

    ddp_notebook.launch(_epochs_of_steps_counted_within_each, cpus=2)
    assert list(ddp_notebook.last_job().history) == [
        {"step": 4 * epoch + i, "steps": 4 * (epoch + 1), "epoch": epoch, "loss": 50.0 + 10 * epoch + i}
        for epoch in range(3) for i in range(4)]  # every epoch's, whole: none partial, none left out
    told = [line for line in capfd.readouterr().err.splitlines() if "went back" in line]
    assert len(told) == 1, told
    assert re.fullmatch(r"ddp_notebook: rank [01]'s step went back from 3 to 0: taken as a new pass, counted on from "
                        r"step 4 so that every pass keeps its records; give report\(\) a step that keeps rising to "
                        r"number them yourself", told[0]), told[0]


def test_report_takes_totals_and_epochs_as_numbers_in_the_call_and_leaves_the_user_s_objects_alone(in_rank):
    """The records are made by the sender thread: what the call was given must be read in the call.  A tensor or
    array total was kept as given and added to when a pass started (``total += offset``), the user's own object;
    a total that is no number failed in the sender thread, which died, and the rank's next flush hung."""
    total = np.array(3)  # (mutable: a 0-d array; a tensor alike)
    for epoch in range(2):
        for i in range(1, 4):
            metrics.report(epoch=np.int64(epoch), step=i, steps=total, loss=float(i))
    sent = [r for _, body in in_rank.sent for r in protocol.expand_reports(body["reports"])]
    assert [(r["x"], r["total"], r["epoch"]) for r in sent] == [(i, 3, 0) for i in (1, 2, 3)] + [
        (i + 3, 6, 1) for i in (1, 2, 3)]
    assert all(type(r["total"]) is float and type(r["epoch"]) is float for r in sent)
    assert total == 3
    with pytest.raises(TypeError, match=r"report\(steps=\.\.\.\) takes a number"):
        metrics.report(step=1, steps=[3], loss=1.0)
    with pytest.raises(TypeError, match=r"report\(epoch=\.\.\.\) takes a number .* of shape \(2,\)"):
        metrics.report(step=1, epoch=np.array([1, 2]), loss=1.0)


def test_reports_to_a_broken_channel_are_dropped_in_the_call(in_rank):
    """Once the notebook is gone, a batch is never sent nor sealed: reports joining it grew it for the rest of the
    run."""
    metrics.report(step=1, loss=1.0)
    in_rank.broken = True
    for step in range(2, 1000):
        metrics.report(step=step, loss=1.0)
    assert len(in_rank.queued) == 1
    assert [r["x"] for _, body in in_rank.sent for r in protocol.expand_reports(body["reports"])] == [1]


def test_reports_from_several_threads_racing_the_sender_each_arrive_once_and_in_order(monkeypatch):
    """report() appends to the calls with no lock while the sender thread takes them from the front: windows of a
    millisecond make the sender take calls while four threads report, 20,000 reports each, the threads switching
    at nearly every bytecode, and every report arrives, once, in the order its thread made it."""
    import socket

    from ddp_notebook.wire.channel import Connection, Sender

    monkeypatch.setattr(metrics, "BATCH_WINDOW_S", 0.001)
    monkeypatch.setattr(metrics, "BUSY_BATCH_WINDOW_S", 0.001)
    monkeypatch.setattr(metrics, "_window_s", 0.001)
    ours, theirs = socket.socketpair()
    sender, reader = Sender(Connection(ours)), Connection(theirs)
    received, messages = [], []

    def read():
        while True:
            try:
                kind, body = reader.recv()
            except (EOFError, OSError):
                return
            messages.append(kind)
            received.extend(protocol.expand_reports(body["reports"]))

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    metrics.begin_task()
    context.set_current(context.RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, sender=sender))
    switch_interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1e-6)  # (threads switch at nearly every bytecode: a window between two steps is hit)
        start = threading.Barrier(4)

        def reporting(thread):
            start.wait()
            for i in range(20_000):
                metrics.report(epoch=i, **{f"thread{thread}": float(i)})
                if i % 500 == 0:
                    time.sleep(0.001)  # (the sender takes batches while the threads report, and between)

        threads = [threading.Thread(target=reporting, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        metrics.hurry()
        sender.close()
        reading.join(10)
        assert not reading.is_alive()
    finally:
        sys.setswitchinterval(switch_interval)
        context.set_current(None)
        metrics.begin_task()
    for thread in range(4):
        name = f"thread{thread}"
        assert [r["values"][name] for r in received if name in r["values"]] == [float(i) for i in range(20_000)]
    assert len(received) == 80_000 and set(messages) == {protocol.METRIC} and len(messages) > 3


def test_a_batch_of_the_last_task_still_queued_as_the_next_starts_takes_only_the_last_task_s_reports(in_rank):
    """A warm pool's rank starts its next task while a batch of the last one may still wait in the sender's queue
    (a thread of the cell that reported after the task's end queued it): it took the new task's reports and placed
    them on the last task's axis, with a false "went back" to the notebook."""
    metrics.report(step=5, loss=1.0)
    metrics.report(step=6, loss=1.0)
    metrics.begin_task()  # the next task; the batch above is not sent yet
    metrics.report(step=1, loss=2.0)
    metrics.report(step=2, loss=2.0)
    batches = [list(protocol.expand_reports(body["reports"])) for _, body in in_rank.sent]
    assert [[(r["x"], r.get("went_back")) for r in batch] for batch in batches] == [
        [(5, None), (6, None)], [(1, None), (2, None)]]


def test_a_batch_that_found_no_reports_reaches_no_callback_nor_view():
    """A report that comes as a batch takes the calls queues another batch, which may find none: that one must not
    count as the job's first report (a dashboard opened for a cell that reports nothing)."""
    forwarded = []

    class Subscriber:
        def metrics_updated(self, updates):
            forwarded.append(updates)

    metrics_of_run = Metrics(2)
    metrics_of_run.subscribe(Subscriber())
    metrics_of_run(None, protocol.METRIC, 0, {"reports": []})
    assert forwarded == []
    metrics_of_run(None, protocol.METRIC, 0, {"reports": [{"key": "step", "x": 1, "values": {"loss": 1.0}}]})
    assert len(forwarded) == 1


def test_a_message_that_cannot_be_pickled_is_dropped_with_a_note_and_the_channel_goes_on(capfd):
    """A rank's sender thread pickles what it sends: an error there used to end the thread, and the rank's next
    flush (every task's end) waited forever."""
    import socket

    from ddp_notebook.wire.channel import Connection, Sender

    ours, theirs = socket.socketpair()
    sender, reader = Sender(Connection(ours)), Connection(theirs)
    try:
        sender.send("display", {"data": lambda: None})  # (no pickle takes a lambda)
        sender.send("metric", {"reports": [1.0]})
        flushed = threading.Thread(target=sender.flush, daemon=True)
        flushed.start()
        flushed.join(10)
        assert not flushed.is_alive() and not sender.broken
        assert reader.recv() == ("metric", {"reports": [1.0]})
        assert "ddp_notebook: a 'display' message could not be sent to the notebook: " in capfd.readouterr().err
    finally:
        sender.close()
        reader.close()


def test_report_refuses_what_is_not_a_number(in_rank):
    with pytest.raises(TypeError, match="report\\(name=...\\) takes a number"):
        metrics.report(epoch=1, name="resnet")
    assert in_rank.sent == []


def test_progress_is_throttled_in_the_rank_but_keeps_the_last(in_rank, monkeypatch):
    monkeypatch.setattr(metrics, "_last_progress_sent", float("-inf"))
    started = time.monotonic()
    for done in range(1, 1001):
        metrics.progress(done, 1000)
    elapsed = time.monotonic() - started
    sent = [body for kind, body in in_rank.sent if kind == "progress"]
    assert 1 <= len(sent) <= elapsed / metrics.PROGRESS_INTERVAL_S + 2
    assert sent[0] == {"done": 1, "total": 1000}
    assert sent[-1] == {"done": 1000, "total": 1000}


class FakeJob:
    """What the watcher reads of a Job."""

    def __init__(self, world_size, callbacks=()):
        self.spec = JobSpec(world_size=world_size)
        self.started_at = time.time()
        self.ended_at = None
        self.metrics = Metrics(world_size, callbacks)  # (as a Job makes its own)
        self.listeners = [self.metrics]
        self.done = False
        self.status = "running"

    def add_listener(self, listener):
        self.listeners.append(listener)

    @property
    def history(self):
        return self.metrics.history

    def emit(self, kind, rank, body):
        for listener in self.listeners:
            listener(self, kind, rank, body)

    def end(self, ok=True):
        self.status = "done" if ok else "failed"
        self.done, self.ended_at = True, time.time()
        self.emit("ended", -1, {"ok": ok})


def report_body(epoch, **values):
    return {"reports": [{"key": "epoch", "x": epoch, "total": 3, "values": values}]}


def test_text_view_prints_one_line_per_epoch_and_forwards(capsys):
    got = []
    job = FakeJob(2, callbacks=[got.append])
    dashboard.watch(job)
    for rank in (0, 1):
        job.emit("ready", rank, {})
    for epoch in (1, 2, 3):
        for rank in (0, 1):
            job.emit("progress", rank, {"done": 4, "total": 4})
            job.emit("metric", rank, report_body(epoch, loss=rank + 1.0))
    job.end()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  (")[0] for line in lines] == [f"epoch {e}/3  loss 1.5" for e in (1, 2, 3)]
    assert "ETA" in lines[0] and "ETA" not in lines[-1]
    assert got == [{"epoch": e, "loss": 1.5} for e in (1, 2, 3)]
    assert job.history == [{"epoch": e, "epochs": 3, "loss": 1.5} for e in (1, 2, 3)]
    watcher = job.listeners[-1]
    assert watcher.status.line(watcher.reducer, time.time()).startswith("done · 2 ranks · epoch 3/3 · ")


def test_a_job_that_reports_nothing_shows_nothing(capsys):
    job = FakeJob(2)
    dashboard.watch(job)
    for rank in (0, 1):
        job.emit("ready", rank, {})
        job.emit("exited", rank, {"code": 0})
    job.end()
    assert capsys.readouterr().out == ""
    assert job.listeners[-1].views == []


def test_failing_callback_is_dropped_with_one_warning_and_training_goes_on(capsys):
    calls = []

    def broken(record):
        calls.append(record)
        raise ValueError("no network")

    job = FakeJob(1, callbacks=[broken])
    dashboard.watch(job)
    with pytest.warns(UserWarning) as warned:
        job.emit("metric", 0, report_body(1, loss=1.0))
    assert len(warned) == 1
    # It names the callback (qualified) and its error, and points at the line that raised, not ddp_notebook's.
    assert str(warned[0].message) == (
        "ddp_notebook: metrics callback test_metrics.test_failing_callback_is_dropped_with_one_warning_and_training_goes_on."
        "<locals>.broken raised ValueError: no network; it gets no more records of this job")
    assert warned[0].filename == __file__
    assert warned[0].lineno == broken.__code__.co_firstlineno + 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        job.emit("metric", 0, report_body(2, loss=1.0))
    job.end()
    assert len(calls) == 1
    assert len(job.history) == 2


def test_tensorboard_callback_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    forward = Forwarder([TensorBoard(str(tmp_path))])
    forward.send([{"epoch": 1, "loss": 1.5, "partial": "loss"}, {"epoch": 2, "loss": 1.25, "acc": 0.5}])
    forward.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 1.5), (2, 1.25)]
    assert [(s.step, s.value) for s in events.Scalars("acc")] == [(2, 0.5)]


def test_wandb_callback_logs_to_the_current_run(monkeypatch):
    logged = []
    fake = types.ModuleType("wandb")
    fake.run = None
    fake.init = lambda **kwargs: setattr(fake, "run", object())
    fake.log = logged.append
    monkeypatch.setitem(sys.modules, "wandb", fake)
    callback = resolve(fake)
    assert isinstance(callback, WandB) and isinstance(resolve("wandb"), WandB)
    callback({"epoch": 1, "loss": 1.5, "partial": "loss"})
    assert fake.run is not None
    assert logged == [{"epoch": 1, "loss": 1.5}]
    with pytest.raises(TypeError):
        resolve(42)


def test_figure_renders_panels_and_thins_long_curves():
    curves = dashboard.Curves()
    for step in range(1, 5001):
        curves.add({"step": step, "train_loss": 1 / step, "val_loss": 2 / step, "acc": 0.5, "lr": 0.1})
    plot = dashboard.Plot()
    png = plot.render(curves.snapshot(), title="done")
    assert png.startswith(b"\x89PNG")
    titles = [ax.get_title() for ax in plot._figure.axes]
    assert titles == ["loss", "accuracy", "lr"]
    line, _ = plot._lines[("step", "train_loss")]
    assert len(line.get_xdata()) <= dashboard.MAX_PLOTTED_POINTS + 1
    assert line.get_xdata()[-1] == 5000
    assert dashboard.Plot().render(dashboard.Curves().snapshot()) is None


def test_status_line_and_eta():
    status = dashboard.Status(world_size=2, started_at=100.0)
    assert status.line(None, 101.0) == "starting: 0/2 ranks ready · 0:01 elapsed"
    from ddp_notebook.engine.history import Reducer

    reducer = Reducer(2)
    for rank in (0, 1):
        status.ready.add(rank)
        reducer.add(rank, {"key": "epoch", "x": 1, "total": 4, "values": {"loss": 1.0}})
    status.training_since = 110.0
    status.progress = {0: (5, 10), 1: (5, 10)}  # half of epoch 2
    # 1.5 epochs in 15 s: 2.5 epochs to go take 25 s.
    assert status.line(reducer, 125.0) == "2/2 ranks alive · epoch 1/4 · 0:25 elapsed · ETA 0:25"
    out = io.StringIO()
    view = dashboard.TextView(types.SimpleNamespace(status=status, reducer=reducer), out=out)
    view.updated([{"step": s, "loss": 1.0} for s in range(3)])
    view.finish([])
    assert len(out.getvalue().splitlines()) == 2  # step-wise lines are paced; the last one is kept


def test_a_value_that_is_no_number_is_refused_naming_its_shape():
    import torch

    for value, said in ((torch.tensor([1.0, 2.0]), "a Tensor of shape (2,): report its mean (.mean()) or one element of "
                                                   "it"),
                        (np.zeros(3), "a ndarray of shape (3,): report its mean (.mean()) or one element of it"),
                        ("abc", "a str"), (None, "None")):
        with pytest.raises(TypeError) as info:
            metrics.report(step=1, loss=value)
        assert str(info.value) == f"report(loss=...) takes a number or a one-element tensor, not {said}"


def test_status_counts_how_far_the_axis_came_not_how_many_reports():
    # report(step=s, steps=200) every 10 steps: the status said "step 10/200" and an ETA 20x too long.
    from ddp_notebook.engine.history import Reducer

    status = dashboard.Status(world_size=2, started_at=100.0)
    status.ready.update((0, 1))
    status.training_since = 100.0
    reducer = Reducer(2)
    for step in range(0, 100, 10):
        for rank in (0, 1):
            reducer.add(rank, {"key": "step", "x": step, "total": 200, "values": {"loss": 1.0}})
    # 91 steps done (0 to 90) in 9.1 s: 109 to go take 10.9 s.
    assert status.line(reducer, 109.1) == "2/2 ranks alive · step 91/200 · 0:09 elapsed · ETA 0:11"
    reducer.new_attempt()  # a restart on fresh ranks replays steps from a checkpoint: they do not count twice
    for step in (50, 60):
        for rank in (0, 1):
            reducer.add(rank, {"key": "step", "x": step, "total": 200, "values": {"loss": 2.0}})
    assert reducer.done("step") == 91
    assert status.line(reducer, 109.1).startswith("2/2 ranks alive · step 91/200 · ")
    for rank in (0, 1):
        reducer.add(rank, {"key": "step", "x": 1_999_999, "total": 2_000_000, "values": {"loss": 2.0}})
    assert status.line(reducer, 109.1).startswith("2/2 ranks alive · step 2000000/2000000 · ")  # (not 2e+06)

    one_based = Reducer(1)
    for epoch in (1, 2):
        one_based.add(0, {"key": "epoch", "x": epoch, "total": 4, "values": {"loss": 1.0}})
    assert one_based.done("epoch") == 2
    fractional = Reducer(1)
    for epoch in (0.0, 0.25, 0.5):
        fractional.add(0, {"key": "epoch", "x": epoch, "total": 2, "values": {"loss": 1.0}})
    assert fractional.done("epoch") == 0.5
    single = dashboard.Status(world_size=1, started_at=100.0)
    single.ready.add(0)
    assert single.line(fractional, 110.0).startswith("1/1 ranks alive · epoch 0.5/2 · 0:10 elapsed")
    baseline = Reducer(1)  # report(epoch=0) before training, then epochs 1 to 4 of epochs=4: not "epoch 5/4"
    for epoch in range(5):
        baseline.add(0, {"key": "epoch", "x": epoch, "total": 4, "values": {"val_loss": 1.0}})
    assert single.line(baseline, 110.0) == "1/1 ranks alive · epoch 4/4 · 0:10 elapsed"
    fractional.add(0, {"key": "epoch", "x": 1.0, "total": 2, "values": {"loss": 1.0}})
    assert fractional.done("epoch") == 1.0  # (not 2: these x's are fractions of an epoch, not epochs counted from 0)
    runs = Reducer(1)  # a batch of reports packed in a run, as a busy rank sends them
    runs.add_many(0, [protocol.pack_reports([{"key": "epoch", "x": x, "total": 2, "values": {"loss": 1.0}}
                                             for x in (0, 0.5, 1)])[0]])
    assert runs.done("epoch") == 1
    assert Reducer(1).done("step") == 0


def test_a_restart_is_marked_in_the_status_line_and_on_the_curves_and_replayed_epochs_replace_the_old(capsys):
    job = FakeJob(2)
    dashboard.watch(job)
    watcher = job.listeners[-1]
    for epoch in (0, 1, 2):
        for rank in (0, 1):
            job.emit("metric", rank, report_body(epoch, loss=10.0 + epoch))
    job.emit("restarted", -1, {"attempt": 1, "attempts": 2, "cause": "rank 1 died (SIGKILL)", "failure": None})
    line = watcher.status.line(watcher.reducer, time.time())
    assert line.endswith(" · rank 1 died (SIGKILL) at epoch 3 — attempt 2 of 2"), line
    job.emit("resumed", 0, {"task": 1, "epoch": 2})
    assert watcher.status.line(watcher.reducer, time.time()).endswith(
        "rank 1 died (SIGKILL) at epoch 3 — attempt 2 of 2, resuming from epoch 2")
    for epoch in (2, 3):  # the checkpoint was older than the last epoch reported: epoch 2 is replayed
        for rank in (0, 1):
            job.emit("metric", rank, report_body(epoch, loss=float(epoch)))
    job.end()
    assert [(r["epoch"], r["loss"]) for r in job.history] == [(0, 10.0), (1, 11.0), (2, 2.0), (3, 3.0)]
    assert job.history.attempts == [{"attempt": 0, "cause": "rank 1 died (SIGKILL)", "at": {"epoch": 3}}]
    snapshot = watcher.curves.snapshot()
    assert snapshot["points"][("epoch", "loss")] == ([0, 1, 2, 3], [10.0, 11.0, 2.0, 3.0])
    assert snapshot["restarts"] == [("epoch", 2.5)]
    assert snapshot["totals"] == {"epoch": 3}  # (report(epochs=3)): the live figure's x axis runs to it
    plot = dashboard.Plot()
    assert plot.render(snapshot).startswith(b"\x89PNG")
    assert [marker.get_xdata()[0] for marker in plot._markers] == [2.5]
    err = capsys.readouterr().err
    assert "ddp_notebook: rank 1 died (SIGKILL) at epoch 3 — attempt 2 of 2\n" in err
    assert "ddp_notebook: attempt 1 resumes from epoch 2" in err  # (a FakeJob has no attempt counter)


def test_during_a_graceful_stop_the_status_counts_ranks_that_returned_as_alive():
    job = FakeJob(2)
    dashboard.watch(job)
    watcher = job.listeners[-1]
    for rank in (0, 1):
        job.emit("ready", rank, {})
    job.emit("metric", 0, report_body(1, loss=1.0))
    job.emit("stopping", -1, {"by": "the interrupt", "grace": 30})
    line = watcher.status.line(watcher.reducer, time.time())
    assert line.startswith("2/2 ranks alive · ") and line.endswith(" · stopping at the next batch (asked by the "
                                                                   "interrupt)"), line
    for rank in (0, 1):  # each stops at the boundary, returns, and its process ends before the job does
        job.emit("result", rank, {"task": 1, "value": None, "stopped": {"epoch": 1, "batch": 3}})
        job.emit("exited", rank, {"code": 0})
        line = watcher.status.line(watcher.reducer, time.time())
        assert "0/2" not in line and "1/2 ranks alive" not in line, line
    assert line.startswith("2/2 ranks stopped, ending · epoch 0/3 · "), line
    job.emit("exited", 1, {"code": -9})  # (again: nothing changes)
    job.end()


def test_rank_0_alone_reporting_is_drawn_live_and_labelled(monkeypatch):
    monkeypatch.setattr(history, "SETTLE_S", 0.3)
    got = []
    job = FakeJob(2, callbacks=[got.append])
    dashboard.watch(job)
    watcher = job.listeners[-1]
    watcher._view_chosen = True  # no view: the test reads the curves
    for epoch in (1, 2):
        job.emit("metric", 0, report_body(epoch, loss=1.0 / epoch))
    assert got == [] and len(job.history) == 0  # rank 1 may still be starting
    deadline = time.time() + 10
    while len(got) < 2 and time.time() < deadline:  # released by the settling timer, no further report needed
        time.sleep(0.05)
    assert got == [{"epoch": 1, "loss": 1.0}, {"epoch": 2, "loss": 0.5}]
    job.emit("metric", 0, report_body(3, loss=1.0 / 3))
    assert got[-1] == {"epoch": 3, "loss": 1.0 / 3} and job.history[-1]["epoch"] == 3
    assert job.history.reporters == {"loss": [0]}
    plot = dashboard.Plot()
    with watcher.lock:
        snapshot = watcher.curves.snapshot()
    plot.render(snapshot)
    assert [ax.get_title() for ax in plot._figure.axes] == ["loss (rank 0)"]
    job.end()
    assert [r["epoch"] for r in job.history] == [1, 2, 3] and not any("partial" in r for r in job.history)


def test_a_live_frame_drawn_over_the_kept_background_is_the_figure_drawn_whole():
    from PIL import Image

    curves = dashboard.Curves()
    curves.totals = {"step": 1000}  # (the reducer's, from report(steps=1000))
    plot = dashboard.Plot()
    for step in range(100):
        curves.add({"step": step, "loss": 2.0 - step / 100, "acc": step / 200})
    plot.render(curves.snapshot())
    assert plot.blitted == 0
    for step in range(100, 300):  # inside the live limits: x runs to the run's end, y has room around the curve
        curves.add({"step": step, "loss": 2.0 - step / 300, "acc": 0.3 + step / 10000})
    blitted = plot.render(curves.snapshot())
    assert plot.blitted == 1
    for ax in plot._figure.axes:
        assert ax.get_xlim()[1] >= 1000
        ax.set_autoscale_on(False)
    for line, partial_line in plot._lines.values():
        line.set_animated(False)
        partial_line.set_animated(False)
    canvas = plot._figure.canvas
    canvas.draw()
    whole = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    assert Image.open(io.BytesIO(blitted)).convert("RGB").tobytes() == whole.convert("RGB").tobytes()


def test_a_curve_leaving_the_live_limits_redraws_the_figure_whole_with_new_limits():
    curves = dashboard.Curves()
    plot = dashboard.Plot()
    for step in range(50):
        curves.add({"step": step, "loss": 1.0})
    plot.render(curves.snapshot())
    curves.add({"step": 50, "loss": 100.0})
    plot.render(curves.snapshot())
    assert plot.blitted == 0
    (ax,) = plot._figure.axes
    assert ax.get_ylim()[1] > 100.0 and ax.get_xlim()[1] > 50
    final = plot.render(curves.snapshot(), title="done")
    assert final.startswith(b"\x89PNG") and plot.blitted == 0
    (ax,) = plot._figure.axes  # (rebuilt with room for its title)
    assert ax.get_xlim()[1] < 55  # the final figure's limits fit the data


def test_the_live_figure_kept_between_jobs_draws_the_next_job_s_curves_alone():
    first, second = dashboard.Curves(), dashboard.Curves()
    for step in range(1000):
        first.add({"step": step, "loss": step / 10})
    for step in range(20):  # inside the first job's limits, and far narrower
        second.add({"step": step, "loss": 40.0 + step / 20})
    plot = dashboard.Plot()
    plot.render(first.snapshot())
    dashboard._keep_spare_plot(plot)
    reused = dashboard._spare_plot()
    assert reused is plot and dashboard._spare_plot() is not plot
    reused.render(second.snapshot())
    assert reused.blitted == 0
    line, _ = reused._lines[("step", "loss")]
    assert list(line.get_ydata()) == [40.0 + step / 20 for step in range(20)]
    (ax,) = reused._figure.axes
    low, high = ax.get_ylim()
    assert 38 < low < 40 and 41 < high < 43 and ax.get_xlim()[1] < 45  # (room as far again ahead)



def _whole_frames_of_a_run(loss, steps: int = 12_000, per_frame: int = 250, total: int | None = None) -> tuple:
    """Frames of a live figure for ``loss(step)`` reported every step, drawn every ``per_frame`` steps (a tick of
    the dashboard): how many were drawn whole after the first, and the last frame's y limits."""
    curves, plot = dashboard.Curves(), dashboard.Plot()
    if total is not None:
        curves.totals = {"step": total}
    frames = 0
    for step in range(steps):
        curves.add({"step": step, "loss": loss(step)})
        if step % per_frame == per_frame - 1:
            plot.render(curves.snapshot())
            frames += 1
    (ax,) = plot._figure.axes
    return frames - 1 - plot.blitted, ax.get_ylim()


@pytest.mark.parametrize("loss, total, most", [
    (lambda step: math.exp(-step / 1500), 12_000, 3),  # falls to zero, the run's length given (steps=)
    (lambda step: 1 / (1 + step / 100), None, 4),  # a long tail, no length given: x needs room too
    (lambda step: 2.3 + 0.3 * math.exp(-step / 3000) + 0.05 * random.Random(step).random(), 12_000, 3),  # plateau
    (lambda step: 1 - 0.9 * math.exp(-step / 2000), 12_000, 3),  # an accuracy rising to one
    (lambda step: -100 * math.exp(-step / 2000), 12_000, 3),  # a negative reward rising to zero
], ids=["falling-to-zero", "long-tail-no-total", "noisy-plateau", "rising-accuracy", "negative-rising-to-zero"])
def test_a_live_curve_settles_inside_its_limits_after_a_few_whole_frames(loss, total, most):
    """A whole frame costs ten times a frame drawn over the kept background, and the drawing budget allows one every
    10 s or so: a curve that keeps leaving the live limits (room of a quarter of its range) froze the live figure.
    Of 48 frames (a 24 s run at two frames a second) at most 3 after the first are drawn whole (4 without the run's
    length; the limits of before drew 4 to 11)."""
    whole, _ = _whole_frames_of_a_run(loss, total=total)
    assert whole <= most


@pytest.mark.parametrize("sign", [1, -1])
def test_the_live_limits_leave_no_room_past_zero_for_a_curve_that_does_not_cross_it(sign):
    curves, plot = dashboard.Curves(), dashboard.Plot()
    curves.totals = {"step": 1000}
    for step in range(100):
        curves.add({"step": step, "loss": sign * (1.0 - step / 110)})  # from 1 to 0.1: room would reach past zero
    plot.render(curves.snapshot())
    (ax,) = plot._figure.axes
    low, high = ax.get_ylim()
    if sign == 1:
        assert low == 0.0 and high > 1.3  # room above
    else:
        assert high == 0.0 and low < -1.3


def test_a_redraw_dearer_than_the_burst_only_puts_the_next_off_until_it_is_paid_for():
    """The drawing budget: a whole figure that cost more than the whole burst (a slow machine, many panels) used
    to stop every later frame but the one MAX_STALE_S forces (10 s apart), as no credit could reach its cost."""
    budget = dashboard.DrawBudget(0.0, share=0.003, burst_s=0.1)
    assert budget.allows(0.0)
    budget.charge(0.15)  # a whole figure: 50 ms of debt, paid off at 0.3 % of the time in 16.7 s
    assert not budget.allows(16.0)
    assert budget.allows(17.0)
    budget.charge(5.0)  # a pathological redraw: what it costs past the burst is forgiven
    assert not budget.allows(50.0) and budget.allows(51.0)


def test_the_drawing_budget_holds_its_share_of_a_core_over_a_long_run():
    budget, spent, now = dashboard.DrawBudget(0.0, share=0.003, burst_s=0.1), 0.0, 0.0
    for tick in range(1, 2_000):  # 1,000 s of ticks twice a second; every frame costs 4 ms, every 50th 40 ms
        now = tick * 0.5
        if budget.allows(now):
            cost = 0.04 if tick % 50 == 0 else 0.004
            budget.charge(cost)
            spent += cost
    assert 0.003 * now * 0.9 <= spent <= 0.003 * now + 0.1 + 0.04

ENGINE_ALONE = r"""
import json, sys
sys.path.insert(0, TESTS)
import torchrun_tasks
from ddp_notebook.engine.job import Job, JobOptions
from ddp_notebook.engine.spec import resolve_devices
from ddp_notebook.wire import payload

got = []
task = payload.dumps(payload.CallTask(torchrun_tasks.reports_three_steps, (), {}, False, payload.Sources()))
job = Job(resolve_devices(cpus=2), task, JobOptions(callbacks=(got.append,))).start()
values = job.wait()
print(json.dumps({"values": values, "history": list(job.history), "got": got,
                  "views": sorted(name for name in sys.modules if name.startswith("ddp_notebook.notebook"))}))
"""


def test_a_job_started_by_the_engine_alone_keeps_its_history_and_calls_its_callbacks(no_leftovers):
    """The engine owns the metrics: a job made without the front door (no dashboard, no view imported) reduces its
    ranks' reports into its history and sends every record to its callbacks."""
    tests = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([sys.executable, "-c", f"TESTS = {tests!r}\n" + ENGINE_ALONE], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["values"] == [0, 1]
    expected = [{"step": step, "steps": 3, "loss": step + 0.5} for step in range(3)]
    assert found["history"] == expected
    assert found["got"] == [{"step": step, "loss": step + 0.5} for step in range(3)]
    assert found["views"] == []  # no view was imported: the metrics are the engine's
