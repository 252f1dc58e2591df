"""Big tensors and arrays reach the ranks through shared memory, mapped copy-on-write, and nothing is left behind."""
import functools
import gc
import os
import tempfile
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

import ddp_notebook
from ddp_notebook.engine import spec as job_spec
from ddp_notebook.engine import job as engine_job
from ddp_notebook.wire import payload
from ddp_notebook.wire import sharing

pytestmark = pytest.mark.timeout(60)



def in_a_fresh_process(test):
    """Run a test that moves a block in a new Python, as a fresh notebook.

    Whether glibc gives a 40 MiB block a mapping of its own (so that it is moved, not copied) depends on what the
    process freed before: after big blocks are freed it keeps up to 64 MiB free in its heap and serves large requests
    from there.  Copying such a block is correct; these tests are about moving.
    """
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get("DDP_NOTEBOOK_TEST_FRESH") == test.__name__:
            return test(*args, **kwargs)
        command = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",  # (one process: no workers)
                   f"{__file__}::{test.__name__}"]
        fresh = {**os.environ, "DDP_NOTEBOOK_TEST_FRESH": test.__name__, "DDP_NOTEBOOK_TEST_TMPDIR": ""}
        out = subprocess.run(command, env=fresh, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]

    return run

MIB = 1 << 20


def _checksum(x):
    """The exact bytes (by hash), shape, dtype, strides and requires_grad of a tensor or array."""
    import hashlib

    t = torch.as_tensor(x).detach()
    digest = hashlib.sha1(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
    strides = tuple(x.strides) if isinstance(x, np.ndarray) else tuple(t.stride())
    return digest, tuple(t.shape), str(t.dtype), strides, bool(getattr(x, "requires_grad", False))


@pytest.fixture
def sent(monkeypatch):
    """What the notebook sent for each job: (payload size, in its message or its file; sharing stats)."""
    records = []
    for_ranks = payload.for_ranks

    def recording(task, directory, name="task.pkl"):
        where = for_ranks(task, directory, name)
        size = len(where["data"]) if "data" in where else os.path.getsize(where["path"])
        records.append((size, dict(task.shared.stats)))
        return where

    monkeypatch.setattr(payload, "for_ranks", recording)
    return records


def _shm_and_tmp():
    """What is in shared memory and the temp folder, less torch's compile cache (``torchinductor_<user>``, made in
    the temp folder once, by the first rank that loads torch._inductor: a test that runs first in a fresh one)."""
    return set(os.listdir("/dev/shm")), {name for name in os.listdir(tempfile.gettempdir())
                                         if not name.startswith("torchinductor_")}


def _fds():
    """This process's open descriptors, each with what it refers to (a number reused for something else differs)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except OSError:  # (the listing's own descriptor, closed by now)
            pass
    return found


def _everywhere(ds, table, custom):
    import torch.distributed as dist

    found = {
        "features": _checksum(ds.tensors[0]), "labels": _checksum(ds.tensors[1]),
        "table": {k: _checksum(v) for k, v in table.items()}, "custom": _checksum(custom.images),
        "custom_item": float(custom[3]),
        "aliased": table["rows"].untyped_storage().data_ptr() == ds.tensors[0].untyped_storage().data_ptr(),
    }
    dist.barrier()
    return found


@pytest.mark.slow
@in_a_fresh_process
def test_big_arrays_anywhere_reach_every_rank_without_riding_in_the_payload(no_leftovers, sent):
    class Images(Dataset):  # defined here: travels by value, like a notebook class
        def __init__(self, images):
            self.images = images

        def __len__(self):
            return len(self.images)

        def __getitem__(self, i):
            return self.images[i].sum()

    # 40 MiB: above glibc's largest mmap threshold (32 MiB), a block of its own that is moved, never copied
    features = torch.randn(10240, 1024)
    ds = TensorDataset(features, torch.arange(10240))
    weights = torch.randn(600, 1000, dtype=torch.float64, requires_grad=True)  # 4.6 MiB, a leaf needing grad
    table = {
        "weights": weights, "fortran": np.asfortranarray(np.random.rand(512, 1024)),  # strides kept
        "every_other": np.random.rand(1024, 1024)[:, ::2],  # a strided view of a bigger array
        "halves": torch.randn(1024, 2048, dtype=torch.float16).t(),  # transposed half precision
        "rows": features[5000:],  # a view of a storage already sent: aliasing kept
    }
    custom = Images(np.random.rand(256, 1024).astype(np.float32) + 1)  # 1 MiB, a Dataset attribute
    expected = {
        "features": _checksum(features), "labels": _checksum(ds.tensors[1]),
        "table": {k: _checksum(v) for k, v in table.items()}, "custom": _checksum(custom.images),
        "custom_item": float(custom[3]), "aliased": True,
    }
    out = ddp_notebook.launch(_everywhere, (ds, table, custom), cpus=2)
    assert out == [expected, expected]
    size, stats = sent[0]
    assert size < 256 * 1024, "the big arrays rode inside the payload"
    assert stats["inline"] == 0 and stats["arrays"] >= 5
    assert stats["moved"] >= 40 * MIB  # the dataset's own storage moved, not copied


def _scribble(ds, arr):
    import torch.distributed as dist

    x = ds.tensors[0]
    if dist.get_rank() == 0:
        x.fill_(-1.0)
        arr[:] = -1.0
    dist.barrier()
    seen = (float(x[:, :4].sum()), float(arr[:4].sum()))
    dist.barrier()
    return seen


@pytest.mark.slow
def test_a_rank_writing_changes_neither_the_notebook_nor_another_rank(no_leftovers, sent):
    x = torch.ones(1024, 1024)
    arr = np.full(MIB // 4, 2.0, dtype=np.float32)
    out = ddp_notebook.launch(_scribble, (TensorDataset(x), arr), cpus=2)
    assert out[0] == (-4096.0, -4.0)  # rank 0 sees its own writes
    assert out[1] == (4096.0, 8.0)  # rank 1 does not
    assert float(x.sum()) == 1024 * 1024 and float(arr.sum()) == 2.0 * (MIB // 4)
    assert sent[0][1]["inline"] == 0


def _where_mapped(arr):
    with open("/proc/self/maps") as f:
        lines = [line for line in f if "ddp_notebook" in line or "(deleted)" in line]
    return float(arr.sum()), [line.split(None, 5)[-1].strip() for line in lines]


@pytest.mark.slow
def test_without_room_in_memory_a_deleted_file_on_disk_is_used(no_leftovers, sent, monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_SHM_LIMIT", "0")  # shared memory "too small": nothing fits
    monkeypatch.setenv("DDP_NOTEBOOK_SHARE_INPLACE", "0")
    before = _shm_and_tmp()
    arr = np.random.rand(3 * MIB // 8)
    out = ddp_notebook.launch(_where_mapped, (arr,), cpus=2)
    stats = sent[0][1]
    assert stats["disk"] == arr.nbytes and stats["memory"] == stats["moved"] == stats["inline"] == 0
    for total, paths in out:
        assert total == pytest.approx(float(arr.sum()))
        assert any(p.startswith(tempfile.gettempdir()) and p.endswith("(deleted)") for p in paths), paths
    assert _shm_and_tmp() == before


def test_when_the_disk_is_full_too_the_array_rides_in_the_payload(monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_SHM_LIMIT", "0")
    monkeypatch.setenv("DDP_NOTEBOOK_SHARE_INPLACE", "0")

    class Full:
        f_bavail, f_frsize = 0, 4096

    monkeypatch.setattr(sharing.os, "statvfs", lambda path: Full())
    arr = np.random.rand(MIB // 4)
    with pytest.warns(UserWarning, match="pickled into the payload"):
        data = payload.dumps(arr)
    assert len(data) > arr.nbytes and data.shared.stats["inline"] == arr.nbytes
    data.shared.release()


def _fails(ds):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one is broken")
    dist.barrier()


def _forever(ds):
    import ddp_notebook.rank.context

    ddp_notebook.rank.context.send("sharing-test-alive", {})
    while True:
        time.sleep(0.1)


@pytest.mark.slow
def test_nothing_is_left_after_success_failure_and_interrupt(no_leftovers, monkeypatch):
    # Copies (a view) and moved storages both; the moved one again with its own memfd each run.
    from ddp_notebook.engine import template

    template.ready_template()  # the rank template (and its connection) lives across jobs: not a leftover of one
    gc.collect()  # (what an earlier test of this process left to the collector closes its descriptors now, not below)
    before_files, before_fds = _shm_and_tmp(), _fds()
    data = torch.randn(10240, 1024)
    ds = TensorDataset(data, torch.randn(20480, 128)[::2])
    assert ddp_notebook.launch(len, (ds,), cpus=2) == [10240, 10240]
    with pytest.raises(ddp_notebook.RankError, match="rank one is broken"):
        ddp_notebook.launch(_fails, (ds,), cpus=2)
    job = engine_job.Job(job_spec.resolve_devices(cpus=2), payload.dumps(payload.CallTask(
        _forever, (ds,), {}, False, payload.Sources()))).start().run_in_background()
    seen = []
    job.add_listener(lambda job, kind, rank, body: seen.append(kind))
    deadline = time.time() + 30
    while seen.count("sharing-test-alive") < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert seen.count("sharing-test-alive") == 2
    job.stop()
    assert _shm_and_tmp() == before_files
    del ds, data, job
    gc.collect()
    assert _fds() - before_fds == set()  # every memfd and deleted file closed: their memory is gone
    with open("/proc/self/maps") as f:
        assert "memfd:ddp_notebook" not in f.read()


# -- in the notebook process ---------------------------------------------------------------------


def _why_not_moved(t) -> dict:
    maps = sharing._Maps()
    addr, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    return {"can_move": sharing._can_move(), "foreign": maps.foreign_allocator, "vmas": len(maps.vmas),
            "own": sharing._own_mapping(maps, addr, nbytes), "record": sharing._moved.get(addr),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("DDP_NOTEBOOK", "MALLOC"))}}


@in_a_fresh_process
def test_moving_in_place_keeps_aliases_and_the_next_job_shares_without_copying():
    x = torch.randn(40 * MIB // 4)
    alias = x.numpy()  # numpy's view of the same memory must stay valid
    expected = x.clone()
    first = payload.dumps(x)
    assert first.shared.stats["moved"] == x.nbytes, _why_not_moved(x)
    assert sharing.settle(30)  # the move runs beside the ranks' start-up
    with open("/proc/self/maps") as f:
        assert "memfd:ddp_notebook" in f.read()
    assert torch.equal(x, expected)
    alias[7] = 42.0
    assert x[7] == 42.0
    started = time.perf_counter()
    second = payload.dumps(x)
    assert time.perf_counter() - started < 0.05 and second.shared.stats["moved"] == x.nbytes
    via_numpy = payload.dumps(alias)  # another alias of the moved block shares the same pages
    assert via_numpy.shared.stats["moved"] == x.nbytes
    via_numpy.shared.release()
    assert payload.dumps(x).shared.stats["moved"] == x.nbytes  # and did not evict the tensor's record
    first.shared.release()
    path = os.path.join(tempfile.gettempdir(), f"sharing-{os.getpid()}.pkl")
    with open(path, "wb") as f:
        f.write(second)
    try:
        loaded = payload.load(path)
    finally:
        os.unlink(path)
    assert loaded[7] == 42.0 and torch.equal(loaded, x)
    loaded[0] = -5.0  # a private page of its own
    assert x[0] == expected[0]
    second.shared.release()
    del x, alias, loaded
    gc.collect()
    with open("/proc/self/maps") as f:
        assert "memfd:ddp_notebook" not in f.read()


@in_a_fresh_process
def test_a_fork_of_the_notebook_gets_copy_on_write_pages_as_before():
    x = torch.zeros(40 * MIB // 4)
    data = payload.dumps(x)
    assert data.shared.stats["moved"] == x.nbytes and sharing.settle(30)
    pid = os.fork()
    if pid == 0:  # (numpy, not torch: OpenMP's thread pool does not survive a fork)
        view = x.numpy()
        view.fill(7.0)
        os._exit(0 if view[100] == 7.0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert float(x.abs().sum()) == 0.0
    data.shared.release()


def test_dtypes_layouts_and_flags_round_trip(tmp_path):
    params = torch.nn.Linear(1024, 512)
    items = {
        "bool": torch.rand(2 * MIB) > 0.5, "complex": torch.randn(256, 1024, dtype=torch.complex64),
        "conj": torch.randn(256, 1024, dtype=torch.complex64).conj(), "bf16": torch.randn(1024, 1024).bfloat16(),
        "expanded": torch.randn(1, 1024).expand(1024, 1024), "param": params.weight,
        "readonly": np.frombuffer(np.random.rand(MIB // 4).tobytes(), dtype=np.float64),
        "structured": np.zeros(MIB // 8, dtype=[("a", "i4"), ("b", "f4")]), "small": np.ones(10),
        "objects": np.array([object()] * (MIB // 8)),
    }
    data = payload.dumps(items)
    path = tmp_path / "p.pkl"
    path.write_bytes(data)
    back = payload.load(str(path))
    for key in ("bool", "complex", "conj", "bf16", "expanded"):
        assert back[key].dtype == items[key].dtype and back[key].stride() == items[key].stride(), key
        assert torch.equal(back[key], items[key]), key
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert torch.equal(back["param"], params.weight)
    assert not back["readonly"].flags.writeable and np.array_equal(back["readonly"], items["readonly"])
    assert back["structured"].dtype == items["structured"].dtype and len(back["objects"]) == MIB // 8
    assert len(data) < MIB  # only the object array and the small one are inside
    data.shared.release()


def test_sharing_off_pickles_everything_as_before(monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_SHARE_MIN_BYTES", "off")
    x = torch.randn(MIB // 2)
    data = payload.dumps(x)
    assert len(data) > x.nbytes and data.shared.stats["arrays"] == 0


@in_a_fresh_process
def test_a_move_that_fails_half_way_is_reported_to_the_ranks_and_later_jobs_copy(monkeypatch, tmp_path):
    x = torch.arange(40 * MIB // 4, dtype=torch.float32)
    expected = x.clone()
    real_write, calls = sharing.write_at, []

    def failing_write(fd, addr, nbytes, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(12, "Cannot allocate memory")
        real_write(fd, addr, nbytes, offset)

    monkeypatch.setattr(sharing, "write_at", failing_write)
    data = payload.dumps(x)
    assert sharing.settle(30)
    monkeypatch.setattr(sharing, "write_at", real_write)
    assert torch.equal(x, expected)  # the part moved and the part not moved both hold their values
    path = tmp_path / "p.pkl"
    path.write_bytes(data)
    with pytest.raises(RuntimeError, match="could not move an array into shared memory"):
        payload.load(str(path))
    again = payload.dumps(x)
    assert again.shared.stats["moved"] == 0 and again.shared.stats["memory"] == x.nbytes
    path.write_bytes(again)
    assert torch.equal(payload.load(str(path)), expected)
    data.shared.release()
    again.shared.release()
