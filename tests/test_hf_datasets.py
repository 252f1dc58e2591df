"""Hugging Face datasets (and pyarrow tables) reach the ranks by shared memory: every element, the features, the format,
the fingerprint and the indices mapping arrive; the Arrow buffers are the notebook's shared copy, not one per rank.

Sizes are drawn around a small sharing threshold (``SHARE``, set through DDP_NOTEBOOK_SHARE_MIN_BYTES for the whole
module, so the rank template stays usable): one column below it, at it, past it, and tables that hold more than it
in all, whose buffers are shared down to ``sharing.ARROW_PART_MIN_BYTES``.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

datasets = pytest.importorskip("datasets")
import pyarrow as pa  # noqa: E402  (datasets requires it)

import ddp_notebook  # noqa: E402
from ddp_notebook.wire import payload, sharing  # noqa: E402

pytestmark = pytest.mark.timeout(600)

SHARE = 8192  # above ARROW_PART_MIN_BYTES, so that both rules are reached
PROFILE = settings(max_examples=int(os.environ.get("DDP_NOTEBOOK_PROPERTY_EXAMPLES", "12")), deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.function_scoped_fixture])

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
KINDS = INTS + FLOATS + ["bool", "string", "list_int32", "list_float32"]


@pytest.fixture(scope="module", autouse=True)
def share_threshold():
    old = os.environ.get("DDP_NOTEBOOK_SHARE_MIN_BYTES")
    os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = str(SHARE)
    datasets.disable_progress_bars()
    yield
    if old is None:
        del os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"]
    else:
        os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = old


def _feature(kind: str):
    if kind.startswith("list_"):
        return datasets.List(datasets.Value(kind[5:]))
    return datasets.Value(kind)


@st.composite
def columns(draw, rows: int):
    """A column of ``rows`` values of one Arrow type, some of them null."""
    kind = draw(st.sampled_from(KINDS))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    if kind in INTS:
        info = np.iinfo(kind)
        values = [int(v) for v in rng.integers(info.min, info.max, size=rows, endpoint=True, dtype=kind)]
    elif kind in FLOATS:
        values = [float(v) for v in rng.standard_normal(rows).astype(kind)]
        for i, special in enumerate([math.nan, math.inf, -math.inf, -0.0]):
            if rows > 5 * i:
                values[5 * i] = special
    elif kind == "bool":
        values = [bool(v) for v in rng.integers(0, 2, size=rows)]
    elif kind == "string":
        values = ["".join(chr(c) for c in rng.integers(32, 0x2FF, size=int(n))) for n in rng.integers(0, 12, rows)]
    else:
        dtype = kind[5:]
        values = [rng.integers(-100, 100, size=int(n)).astype(dtype).tolist() for n in rng.integers(0, 6, rows)]
    if draw(st.booleans()):  # nulls
        for i in rng.choice(rows, size=max(1, rows // 7), replace=False):
            values[int(i)] = None
    return kind, values


@st.composite
def rows_near_the_threshold(draw) -> int:
    """A row count whose 1-, 4- or 8-byte column sits at the sharing threshold, a table part's, or anywhere."""
    itemsize = draw(st.sampled_from([1, 4, 8]))
    near = draw(st.sampled_from([SHARE, sharing.ARROW_PART_MIN_BYTES, 4 * SHARE]))
    return draw(st.one_of(st.just(max(1, near // itemsize + draw(st.integers(-2, 2)))), st.integers(1, 40)))


def _transform(ds, step: str, seed: int):
    """A dataset after one of the steps that make an indices mapping (or a slice of the table)."""
    n = len(ds)
    if step == "shuffle":
        return ds.shuffle(seed=seed)
    if step == "select":
        picks = np.random.default_rng(seed).choice(n, size=max(1, n // 2), replace=True)
        return ds.select(picks.tolist())
    if step == "filter":
        return ds.filter(lambda _, i: (i * 7 + seed) % 3 != 0, with_indices=True)
    if step == "range":
        return ds.select(range(n // 3, n))  # contiguous: a slice of the table, no indices mapping
    return ds


@st.composite
def hf_datasets(draw):
    """An in-memory or memory-mapped dataset of 1-4 generated columns, transformed, with a format."""
    rows = draw(rows_near_the_threshold())
    cols = draw(st.lists(columns(rows), min_size=1, max_size=4))
    features = datasets.Features({f"c{i}_{kind}": _feature(kind) for i, (kind, _) in enumerate(cols)})
    data = {name: pa.array(values, type=features.arrow_schema.field(name).type)
            for (name, feature), (_, values) in zip(features.items(), cols)}
    ds = datasets.Dataset.from_dict(data, features=features)
    if draw(st.booleans()):
        folder = tempfile.mkdtemp(prefix="hf-")
        ds.save_to_disk(folder)
        ds = datasets.load_from_disk(folder)
    seed = draw(st.integers(0, 1000))
    for step in draw(st.lists(st.sampled_from(["none", "shuffle", "select", "filter", "range"]), max_size=2)):
        ds = _transform(ds, step, seed)
    fmt = draw(st.sampled_from([None, "numpy", "torch", "torch-some"]))
    if fmt == "torch-some":  # some columns formatted, the others as Python objects
        numeric = [name for name in ds.column_names if not name.endswith("string")][:1]
        ds = ds.with_format("torch", columns=numeric, output_all_columns=True)
    elif fmt is not None:
        ds = ds.with_format(fmt)
    return ds


def _canonical(value):
    """Python values to compare element for element: NaN equal to NaN, -0.0 told from 0.0, tensors and arrays as
    (dtype, nested lists)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), _canonical(value.tolist()))
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return ("object", [_canonical(v) for v in value])
        return ("array", str(value.dtype), _canonical(value.tolist()))
    if isinstance(value, np.generic):
        return _canonical(value.item())
    if isinstance(value, float):
        return ("nan",) if math.isnan(value) else (value, math.copysign(1.0, value))
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value


def _formatted(read):
    """What reading a dataset gives, or the error it raises (torch cannot format some columns with nulls): the same
    on both sides."""
    try:
        return _canonical(read())
    except Exception as exc:  # noqa: BLE001 - compared, not hidden
        return ("error", type(exc).__name__)


def _described(ds) -> dict:
    """Everything that must survive the trip, element for element."""
    return {"len": len(ds), "format": ds.format, "features": ds.features, "fingerprint": ds._fingerprint,
            "indices": None if ds._indices is None else ds._indices.column(0).to_pylist(),
            "formatted": _formatted(lambda: ds[:]) if len(ds) else None,
            "rows": _formatted(lambda: [ds[i] for i in range(min(len(ds), 3))]),
            "python": _canonical(ds.with_format(None).to_dict())}


def _shared_mappings() -> list[tuple[int, int, str]]:
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append((lo, hi, parts[5].strip() if len(parts) > 5 else ""))
    return found


def _buffers(table: pa.Table) -> list[pa.Buffer]:
    found = []
    for column in table.columns:
        for chunk in column.chunks:
            found += [b for b in chunk.buffers() if b is not None]
    return found


def _where_the_buffers_are(table: pa.Table) -> dict[str, int]:
    """How many bytes of the table's big buffers lie in a mapping of the notebook's shared copies, of a dataset's
    Arrow file, or elsewhere (this process's own memory)."""
    maps = _shared_mappings()
    where = {"shared": 0, "file": 0, "own": 0}
    for buf in _buffers(table):
        if buf.size < SHARE:
            continue
        path = next((p for lo, hi, p in maps if lo <= buf.address < hi), "")
        kind = "shared" if "ddp_notebook" in path else "file" if path.endswith(".arrow") else "own"
        where[kind] += buf.size
    return where


def _on_a_rank(dsets: list) -> list[dict]:
    import torch.distributed as dist

    found = [{**_described(ds), "where": _where_the_buffers_are(ds.data.table), "back": ds} for ds in dsets]
    dist.barrier()
    return found


@PROFILE
@given(dsets=st.lists(hf_datasets(), min_size=1, max_size=3))
def test_datasets_arrive_element_for_element_in_a_real_two_rank_job(dsets):
    expected = [_described(ds) for ds in dsets]
    out = ddp_notebook.launch(_on_a_rank, (dsets,), cpus=2)
    for rank, found in enumerate(out):
        for i, (got, want, ds) in enumerate(zip(found, expected, dsets)):
            back = got.pop("back")
            where = got.pop("where")
            assert got == want, f"rank {rank}, dataset {i}"
            in_memory = not ds.cache_files
            if in_memory:  # every big buffer is the notebook's shared copy, none the rank's own
                assert where["own"] == 0 and where["file"] == 0, (rank, i, where)
            else:  # datasets reopens the file memory-mapped: nothing of it in the payload
                assert where["own"] == 0 and where["shared"] == 0, (rank, i, where)
            assert _described(back) == want, f"rank {rank}, dataset {i} back in the notebook"
    assert [_described(ds) for ds in dsets] == expected  # the notebook's own are left as they were


def _payload_and_rank_view(ds):
    import torch.distributed as dist

    table = ds.data.table
    found = (_where_the_buffers_are(table), float(ds[:]["x"].sum()), ds.format["type"], len(ds))
    dist.barrier()
    return found


def test_a_datasetdict_and_a_table_travel_by_reference_not_inside_the_payload(monkeypatch):
    sent = []
    for_ranks = payload.for_ranks

    def recording(task, directory, name="task.pkl"):
        where = for_ranks(task, directory, name)
        sent.append((len(where["data"]) if "data" in where else os.path.getsize(where["path"]),
                     dict(task.shared.stats)))
        return where

    monkeypatch.setattr(payload, "for_ranks", recording)
    x = np.random.default_rng(0).random((8192, 128), dtype=np.float32)  # 4 MiB
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"x": x}).with_format("torch")})
    dd["test"] = dd["train"].shuffle(seed=0).select(range(100))
    out = ddp_notebook.launch(_payload_and_rank_view, (dd["train"],), cpus=2)
    where, total, fmt, n = out[0]
    assert out[0] == out[1]
    assert (fmt, n) == ("torch", 8192) and total == pytest.approx(float(x.sum(dtype=np.float64)), rel=1e-5)
    assert where["shared"] >= x.nbytes and where["own"] == 0
    size, stats = sent[-1]
    assert size < 64 * 1024 and stats["memory"] >= x.nbytes and stats["inline"] == 0

    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 128), "s": pa.array([str(i) for i in range(len(x))])})
    back = ddp_notebook.launch(_identity, ({"dd": dd, "table": table},), cpus=2)[0]
    assert back["table"].equals(table)
    assert torch.equal(back["dd"]["test"][:]["x"], dd["test"][:]["x"])
    assert sent[-1][0] < 64 * 1024 and sent[-1][1]["inline"] == 0


def _identity(value):
    return value


def test_a_rank_imports_no_arrow_unless_the_payload_holds_arrow():
    code = ("import sys, torch, ddp_notebook\n"
            "def arrow_here():\n"
            "    import sys\n"
            "    return sorted(m for m in ('pyarrow', 'datasets', 'pandas') if m in sys.modules)\n"
            "print(ddp_notebook.launch(arrow_here, cpus=2))\n"
            "assert 'pyarrow' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[[], []]"
