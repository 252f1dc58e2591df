"""Jobs leave no thread and no listening socket behind in the process that ran them.

Listening sockets are read from the kernel's socket table (``/proc/net/tcp{,6}``), since a listener
closed under a thread blocked in ``accept()`` goes on listening with no fd left.
"""
import gc
import os
import socket
import threading
import time
import tracemalloc
import types

import pytest

import ddp_notebook
from ddp_notebook import RankError
from ddp_notebook.wire import channel
from ddp_notebook.notebook import dashboard
from ddp_notebook.engine.metrics import Metrics
from sockets import listeners, new_listeners

pytestmark = pytest.mark.timeout(120)


def _one():
    return 1


def _fails():
    raise ValueError("on purpose")


def _length(data):
    return len(data)


def _sleeps():
    import time

    time.sleep(60)


def _threads():
    return sorted(t.name for t in threading.enumerate())


def _settled(threads_before, listeners_before, within=5.0):
    """(threads, new listeners) once both are back where they were, or as they are at the deadline."""
    deadline = time.monotonic() + within
    while True:
        threads, new = _threads(), new_listeners(listeners_before)
        if threads == threads_before and not new or time.monotonic() > deadline:
            return threads, new
        time.sleep(0.05)


def test_a_channel_server_ends_its_threads_and_its_port_on_close():
    threads, before = _threads(), listeners()
    server = channel.ChannelServer()
    silent = socket.create_connection(server.address)  # connects and never answers the challenge
    good = channel.connect(server.address, server.key)
    deadline = time.monotonic() + 5
    while not server.new_connections() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert new_listeners(before) == {("0100007F", server.address[1])}
    started = time.monotonic()
    server.close()
    assert time.monotonic() - started < 2  # the silent peer's handshake was woken, not waited out
    assert (_threads(), new_listeners(before)) == (threads, set())  # at once: close() joined them
    silent.close()
    good.close()


def test_a_view_added_after_the_job_ended_is_finished_at_once_and_finished_views_are_let_go():
    """A dashboard shown as the job ends must not tick (a thread) forever; one finished is not kept (its figure and
    outputs would live as long as the job: a background job is the cell's value, for the kernel's life)."""

    class Job:
        spec = types.SimpleNamespace(world_size=2)
        started_at = ended_at = time.time()
        status = "done"

    class View:
        finished = False

        def finish(self, updates):
            self.finished = True

    job = Job()
    job.metrics = Metrics(2)
    watcher = dashboard.Watcher(job)
    early, late = View(), View()
    watcher.add_view(early)
    assert watcher.views == [early]
    job.metrics(job, "ended", -1, {"ok": True})  # (the job's metrics tell its watcher)
    watcher.add_view(late)
    assert early.finished and late.finished and watcher.views == []


@pytest.mark.slow
def test_jobs_leave_no_thread_and_no_listening_port(no_leftovers):
    threads, before = _threads(), listeners()
    for _ in range(2):
        assert ddp_notebook.launch(_one, cpus=2) == [1, 1]
    with pytest.raises(RankError):
        ddp_notebook.launch(_fails, cpus=2)
    assert ddp_notebook.launch(_one, cpus=2, background=True).wait(timeout=60) == [1, 1]
    stopped = ddp_notebook.launch(_sleeps, cpus=2, background=True)
    stopped.stop()
    assert stopped.status == "stopped"
    assert _settled(threads, before) == (threads, set())


@pytest.mark.slow
def test_a_finished_background_job_lets_go_of_what_it_sent_the_ranks(no_leftovers):
    """A background job lives as long as something refers to it (in a notebook, Out[n]): its pickled task (8 MiB of
    arguments here, pickled inline) goes when it ends, its results stay."""
    assert ddp_notebook.launch(_length, args=(b"warm-up",), cpus=2, background=True).wait(timeout=60) == [7, 7]
    gc.collect()
    tracemalloc.start()
    try:
        job = ddp_notebook.launch(_length, args=(os.urandom(8 << 20),), cpus=2, background=True)
        assert job.wait(timeout=60) == [8 << 20] * 2
        gc.collect()
        retained = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert job.results == [8 << 20] * 2 and job.status == "done"
    assert retained < 1 << 20, f"the finished job keeps {retained / 2**20:.1f} MiB"
