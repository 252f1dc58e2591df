"""Big results come back as big arguments go out: the tensors and arrays of a rank's result over the sharing
threshold travel through a memfd of the notebook's own, which the notebook maps instead of unpickling a copy; every
element arrives, aliases stay aliases, a rank may end as soon as it has sent, and nothing is left behind."""
from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddp_notebook
from ddp_notebook.engine import pool, spec as job_spec
from ddp_notebook.wire import payload, sharing
from nbrun import execute, kernel
from test_data_properties import (PROFILE, SHARE, check_all, payloads, same_tensor, share_threshold, snapshot,
                                  tensors)

pytestmark = pytest.mark.timeout(600)

# Each example of these starts a job: fewer of them, and the no_leftovers fixture checks after the last one.
JOBS = settings(max_examples=int(os.environ.get("DDP_NOTEBOOK_PROPERTY_JOBS", "6")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
RESULTS_FILE = "/memfd:ddp_notebook-results"


def _results_regions() -> list[tuple[int, int]]:
    """Address ranges of this process mapped from results files."""
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            if RESULTS_FILE in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                regions.append((start, end))
    return regions


def _address(x) -> int:
    return x.untyped_storage().data_ptr() if isinstance(x, torch.Tensor) else x.ctypes.data


def _big(x) -> bool:
    """Is this item over the threshold (the elements it shows, as the store counts them)?"""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size() >= SHARE
    return x.nbytes >= SHARE


def assert_mapped_from_results(back, items):
    """Every big item came back backed by a results file; the small ones were pickled as before."""
    regions = _results_regions()
    for i, (got, want) in enumerate(zip(back, items)):
        inside = any(start <= _address(got) < end for start, end in regions)
        assert inside == _big(want), f"item {i}: {'not ' if _big(want) else ''}in a results file"


def assert_aliases_kept(back, items):
    """The same object twice in the result is one object in the notebook."""
    for i, a in enumerate(items):
        for j, b in enumerate(items):
            if a is b:
                assert back[i] is back[j], f"items {i} and {j}"


def _nothing():
    return None


def assert_nothing_left(where: dict | None = None):
    """No results file open or mapped in the notebook once its results are gone.  (A job that returns nothing runs
    first, ``where`` the one before did: ``last_job()`` keeps the results of the one before.)"""
    if where is not None:
        ddp_notebook.launch(_nothing, **where)
    gc.collect()
    assert _results_regions() == []
    fds = os.listdir("/proc/self/fd")
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    assert [link for link in links if "ddp_notebook" in link] == []


@pytest.fixture
def dev_shm_unchanged():
    before = set(os.listdir("/dev/shm"))
    yield
    assert set(os.listdir("/dev/shm")) - before == set()


def _echo(items):
    """Rank side: the items it was sent, nested and flat."""
    return {"flat": items, "nested": [tuple(items)]}


def _check_echoed(back, items, expected):
    check_all(back["flat"], items, expected)
    check_all(back["nested"][0], items, expected)
    assert_aliases_kept(back["flat"], items)
    assert all(a is b for a, b in zip(back["flat"], back["nested"][0]))
    assert_mapped_from_results(back["flat"], items)


# -- the result's trip, in one process ---------------------------------------------------------------------------


@PROFILE
@given(items=payloads())
def test_a_result_arrives_exactly_through_the_results_file(items):
    expected = snapshot(items)
    fd = sharing.results_file()
    try:
        with share_threshold(SHARE):
            sent = payload.dumps_result(_echo(items), into=(os.getpid(), fd))
        payload.release(sent)  # as the rank does once it has sent: the file holds everything
        back = payload.loads(bytes(sent))
    finally:
        os.close(fd)
    _check_echoed(back, items, expected)
    del back
    assert_nothing_left()


@PROFILE
@given(source=tensors())
def test_views_of_one_storage_come_back_views_of_one_storage(source):
    base, view = source
    if view.is_conj() or view.is_neg() or type(view) is not torch.Tensor:
        view = base
    fd = sharing.results_file()
    try:
        with share_threshold(SHARE):
            sent = payload.dumps_result([base, view], into=(os.getpid(), fd))
        payload.release(sent)
        back = payload.loads(bytes(sent))
    finally:
        os.close(fd)
    assert same_tensor(back[0], base) and same_tensor(back[1], view)
    if base.untyped_storage().nbytes() >= SHARE:
        assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()
        assert back[1].storage_offset() == view.storage_offset() and back[1].stride() == view.stride()


def test_without_a_results_file_a_result_is_pickled_as_before():
    earlier = set(_results_regions())  # (``last_job()`` may still hold the results of an earlier test's job)
    items = [torch.arange(1 << 20, dtype=torch.float32), np.arange(1 << 20)]
    back = payload.loads(bytes(payload.dumps_result(items)))
    assert torch.equal(back[0], items[0]) and np.array_equal(back[1], items[1])
    assert set(_results_regions()) - earlier == set()


def test_a_result_that_finds_no_room_in_memory_is_pickled_into_its_message_with_a_warning(monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_SHM_LIMIT", "0")
    earlier = set(_results_regions())  # (``last_job()`` may still hold the results of an earlier test's job)
    value = torch.arange(1 << 20, dtype=torch.float64)
    fd = sharing.results_file()
    try:
        with pytest.warns(UserWarning, match="pickled into the result message"):
            sent = payload.dumps_result(value, into=(os.getpid(), fd))
        payload.release(sent)
        assert len(sent) > value.numel() * 8 and os.fstat(fd).st_size == 0
        back = payload.loads(bytes(sent))
    finally:
        os.close(fd)
    assert torch.equal(back, value) and set(_results_regions()) - earlier == set()


# -- through real ranks --------------------------------------------------------------------------------------------


@JOBS
@given(items=payloads())
def test_launch_results_arrive_exactly_from_fresh_ranks(items, no_leftovers, dev_shm_unchanged):
    expected = snapshot(items)
    with share_threshold(SHARE):
        results = ddp_notebook.launch(_echo, (items,), cpus=2)
    assert len(results) == 2
    for back in results:
        _check_echoed(back, items, expected)
    del results, back
    assert_nothing_left({"cpus": 2})


@pytest.fixture
def warm(no_leftovers):
    """A warm pool of 2 ranks started with the small sharing threshold (the ranks read it at start); one test's
    examples share it."""
    with share_threshold(SHARE):
        ranks = pool.Pool(job_spec.resolve_devices(cpus=2)).start()
    yield ranks
    ranks.stop()


@JOBS
@given(items=payloads())
def test_warm_pool_results_arrive_exactly(items, warm, dev_shm_unchanged):
    expected = snapshot(items)
    with share_threshold(SHARE):
        results = ddp_notebook.launch(_echo, (items,))
    assert len(results) == 2
    for back in results:
        _check_echoed(back, items, expected)
    del results, back
    assert_nothing_left({})


def _returns_then_dies(n):
    """Rank side: rank 0's process ends the moment its result is on the wire."""
    import os

    import torch
    from ddp_notebook.rank import context
    from ddp_notebook.wire import protocol

    sender = context.current().sender
    send_now = sender.send_now

    def send_then_die(kind, body=None):
        send_now(kind, body)
        if kind == protocol.RESULT and context.current().rank == 0:
            os._exit(0)

    sender.send_now = send_then_die
    torch.manual_seed(n)
    return torch.randn(n)


def test_a_rank_that_ends_right_after_sending_its_result_still_delivers_it(no_leftovers, dev_shm_unchanged):
    n = 3 << 20  # 12 MiB of float32
    results = ddp_notebook.launch(_returns_then_dies, (n,), cpus=2)
    torch.manual_seed(n)
    want = torch.randn(n)
    assert [torch.equal(r, want) for r in results] == [True, True]
    assert all(any(start <= _address(r) < end for start, end in _results_regions()) for r in results)
    del results
    assert_nothing_left({"cpus": 2})


def _big_state(n, seed):
    import torch

    torch.manual_seed(seed)
    return {"weight": torch.randn(n), "ids": torch.randint(0, 1000, (n,))}


def test_the_notebook_keeps_working_while_a_background_job_returns_a_big_result(no_leftovers, dev_shm_unchanged):
    n = 4 << 20  # 16 + 32 MiB a rank
    job = ddp_notebook.launch(_big_state, (n, 1), cpus=2, background=True)
    # Meanwhile the notebook runs jobs of its own, whose big results it loads on its thread as the job's thread
    # loads the background job's.
    done = []
    while not job.done or not done:
        results = ddp_notebook.launch(_big_state, (n // 4, len(done) + 2), cpus=2)
        torch.manual_seed(len(done) + 2)
        want = torch.randn(n // 4)
        assert [torch.equal(r["weight"], want) for r in results] == [True, True]
        done.append(len(results))
        assert len(done) < 50
    background = job.wait(timeout=120)
    torch.manual_seed(1)
    weight, ids = torch.randn(n), torch.randint(0, 1000, (n,))
    assert [torch.equal(r["weight"], weight) and torch.equal(r["ids"], ids) for r in background] == [True, True]
    del background, results, job
    assert_nothing_left({"cpus": 2})


# -- --return in a kernel ------------------------------------------------------------------------------------------


def test_return_of_a_model_from_fresh_ranks_and_a_warm_pool_maps_it_from_the_results_file(no_leftovers):
    cell = ("%%ddp {flags} --return model, digest\n"
            "import hashlib, torch\n"
            "torch.manual_seed(0)\n"
            "model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.Linear(2048, 1024))\n"
            "digest = [hashlib.sha1(p.detach().numpy().tobytes()).hexdigest() for p in model.parameters()]")
    check = ("import hashlib\n"
             "regions = [[int(x, 16) for x in line.split()[0].split('-')]\n"
             "           for line in open('/proc/self/maps') if 'ddp_notebook-results' in line]\n"
             "print([hashlib.sha1(p.detach().numpy().tobytes()).hexdigest() for p in model.parameters()] == digest)\n"
             "print(all(any(a <= p.data_ptr() < b for a, b in regions) for p in model.parameters() if p.numel() >= 1 << 18))")
    with kernel() as (_, kc):
        fresh = execute(kc, [cell.format(flags="--cpus 2"), check])
        warm = execute(kc, ["%ddp_start --cpus 2", cell.format(flags=""), check, "%ddp_stop"])
        gone = execute(kc, ["del model", "%%ddp --cpus 2\npass",  # (the last job keeps its results)
                            "import gc; gc.collect()\n"
                            "print('ddp_notebook-results' in open('/proc/self/maps').read())"])
    assert fresh.split()[-2:] == ["True", "True"], fresh
    assert [line for line in warm.splitlines() if line in ("True", "False")] == ["True", "True"], warm
    assert gone.strip() == "False", gone
