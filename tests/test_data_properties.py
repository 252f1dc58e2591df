"""Property tests: whatever carries user data (the payload and its shared buffers, ``--return``, exports,
checkpoints) delivers every element exactly, for every dtype, view kind, size around the thresholds, nesting
and aliasing; and the notebook's own objects keep their values.

Sizes are drawn around a small sharing threshold (``SHARE``: set through DDP_NOTEBOOK_SHARE_MIN_BYTES) so that
both sides of every rule are cheap to reach: below it, at it, one element past it, views of about half a
storage (whole storage or own copy), and blocks big enough to be moved into shared memory.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_notebook.rank import checkpoint
from ddp_notebook.engine import export as exporting
from ddp_notebook.wire import payload
from ddp_notebook.wire import sharing

SHARE = 4096
PROFILE = settings(max_examples=int(os.environ.get("DDP_NOTEBOOK_PROPERTY_EXAMPLES", "60")), deadline=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
NUMPY_DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
                np.float16, np.float32, np.float64, np.complex64, np.complex128]
TENSOR_VIEWS = ["whole", "rows", "step", "transpose", "column", "block", "half", "half+1", "expand", "conj", "neg",
                "param"]
ARRAY_VIEWS = ["whole", "rows", "step", "transpose", "reversed", "fortran", "columns", "block", "half", "readonly"]
# Views that reach the ranks through a temporary copy of their own elements:
COPIED_TENSOR_VIEWS = ["conj", "neg", "column", "block"]
COPIED_ARRAY_VIEWS = ["block", "reversed"]


@contextlib.contextmanager
def share_threshold(nbytes: int):
    old = os.environ.get("DDP_NOTEBOOK_SHARE_MIN_BYTES")
    os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = str(nbytes)
    try:
        yield
    finally:
        if old is None:
            del os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"]
        else:
            os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = old


@st.composite
def element_counts(draw, itemsize: int) -> int:
    """A number of elements whose byte size sits at one of the thresholds, or anywhere up to a moved block."""
    near = draw(st.sampled_from([SHARE, 2 * SHARE, 4 * SHARE, 512 * 1024]))
    return max(1, near // itemsize + draw(st.integers(-2, 2)))


def _fill_tensor(dtype, shape, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex or dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float64 if not dtype.is_complex else torch.complex128)
        flat = t.view(-1)
        for i, special in enumerate([float("nan"), float("inf"), -float("inf"), -0.0]):
            if flat.numel() > 7 * i:
                flat[7 * i] = special
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


@st.composite
def tensors(draw, kinds=TENSOR_VIEWS):
    """A base tensor (rows x cols) of any dtype and a view of it of any of ``kinds``."""
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = draw(element_counts(itemsize))
    cols = draw(st.sampled_from([1, 2, 3, 8, 64]))
    rows = max(2, -(-n // cols))
    base = _fill_tensor(dtype, (rows, cols), draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(kinds))
    if kind in ("conj", "neg") and not dtype.is_complex:
        kind = "block"
    if kind == "rows":
        view = base[draw(st.integers(0, rows // 2)):]
    elif kind == "step":
        view = base[::2]
    elif kind == "transpose":
        view = base.t()
    elif kind == "column":
        view = base[:, cols // 2]
    elif kind == "block":
        view = base[:, 1: cols // 3 + 1] if cols > 2 else base[1: rows // 3 + 1]
    elif kind in ("half", "half+1"):
        view = base.view(-1)[: base.numel() // 2 + (kind == "half+1")]
    elif kind == "expand":
        view = base[:1].expand(rows * 4, cols)
    elif kind == "conj":
        view = base.conj()
    elif kind == "neg":
        view = base.conj().imag  # a negative view
    elif kind == "param" and (dtype.is_floating_point or dtype.is_complex):
        view = torch.nn.Parameter(base, requires_grad=draw(st.booleans()))
    else:
        view = base
    return base, view


@st.composite
def arrays(draw, kinds=ARRAY_VIEWS):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    n = draw(element_counts(dtype.itemsize))
    cols = draw(st.sampled_from([1, 3, 8, 500]))
    rows = max(2, -(-n // cols))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    raw = rng.integers(0, 256, size=rows * cols * dtype.itemsize, dtype=np.uint8)
    if dtype.kind in "fc":  # random bytes: NaNs of every payload included
        base = raw.view(dtype).reshape(rows, cols)
    else:
        base = raw.view(dtype).reshape(rows, cols).copy()
    if dtype.kind == "b":
        base = raw[: rows * cols].reshape(rows, cols) > 127
    kind = draw(st.sampled_from(kinds))
    view = {"whole": lambda: base, "rows": lambda: base[rows // 3:], "step": lambda: base[:, ::2],
            "transpose": lambda: base.T, "reversed": lambda: base[::-1, ::-1],
            "fortran": lambda: np.asfortranarray(base), "columns": lambda: base[:, : max(1, cols // 2)],
            "block": lambda: base[:, 1: cols // 3 + 1] if cols > 2 else base[1: rows // 3 + 1],
            "half": lambda: base.reshape(-1)[: base.size // 2], "readonly": lambda: _readonly(base)}[kind]()
    return base, view


def _readonly(a):
    v = a.view()
    v.flags.writeable = False
    return v


def same_tensor(got, want, kind: bool = True) -> bool:
    """Element for element, bit for bit (NaNs and signed zeros included), with dtype and shape; and with
    ``kind``, the same class (Parameter or not) and grad flag."""
    if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if kind and (got.requires_grad != want.requires_grad or type(got) is not type(want)):
        return False
    a = got.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    b = want.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if a.dtype.is_complex:
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def same_array(got, want) -> bool:
    return (isinstance(got, np.ndarray) and got.dtype == want.dtype and got.shape == want.shape
            and np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()
            and got.flags.writeable == want.flags.writeable)


def snapshot(items):
    return [t.detach().clone() if isinstance(t, torch.Tensor) else np.array(t, copy=True) for t in items]


def check_all(back, items, expected):
    for i, (got, want) in enumerate(zip(back, expected)):
        if isinstance(want, torch.Tensor):
            assert same_tensor(got, items[i]) and same_tensor(got, want, kind=False), f"item {i}"
        else:
            assert same_array(got, items[i]), f"item {i}"
            assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), f"item {i}"


def trip(obj, **dumps_options):
    """Through the payload as the notebook writes it and a rank loads it."""
    data = payload.dumps(obj, **dumps_options)
    fd, path = tempfile.mkstemp()
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return payload.load(path)
    finally:
        os.unlink(path)
        data.shared.release()


@st.composite
def families(draw):
    """Two to six bases of one dtype and shape, each seen through the same kind of view (equal sizes and
    layouts are where a buffer could be taken for another's)."""
    seed = draw(st.integers(0, 2**31))
    make = draw(st.sampled_from([tensors(COPIED_TENSOR_VIEWS), arrays(COPIED_ARRAY_VIEWS), tensors(), arrays()]))
    count = draw(st.integers(2, 6))
    family = [draw(make)]
    for i in range(1, count):
        base, view = family[0]
        if isinstance(base, torch.Tensor):
            other = _fill_tensor(base.dtype, tuple(base.shape), seed + i)
        else:
            other = np.random.default_rng(seed + i).integers(0, 256, size=base.nbytes, dtype=np.uint8)
            other = other.view(base.dtype).reshape(base.shape) if base.dtype.kind != "b" else other.reshape(
                base.shape) > 127
        family.append((other, _same_view(view, base, other)))
    return family


def _same_view(view, base, other):
    """``other`` seen as ``view`` sees ``base``."""
    if isinstance(view, torch.nn.Parameter):
        return torch.nn.Parameter(other, requires_grad=view.requires_grad)
    if isinstance(base, torch.Tensor):
        if view.is_neg():
            return other.conj().imag
        out = other.as_strided(view.shape, view.stride(), view.storage_offset()) if view.data_ptr() != 0 else other
        return out.conj() if view.is_conj() else out
    if view.base is None and view is not base:  # its own copy (fortran)
        return np.asfortranarray(other) if view.flags.f_contiguous else other.copy()
    offset = view.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    out = np.ndarray(view.shape, view.dtype, buffer=other, offset=offset, strides=view.strides)
    if not view.flags.writeable:
        out.flags.writeable = False
    return out


@st.composite
def payloads(draw):
    """Several items over one to six bases, nested, with an alias of the same object."""
    sources = draw(st.one_of(st.lists(st.one_of(tensors(), arrays()), min_size=1, max_size=3), families()))
    items = [view for _, view in sources]
    for base, _ in sources:
        if draw(st.booleans()):
            items.append(base)  # a view and its base in one payload
    items += [draw(st.sampled_from(items)) for _ in range(draw(st.integers(0, 2)))]
    return items


@PROFILE
@given(items=payloads(), snapshot_only=st.booleans())
def test_payload_delivers_every_element_and_leaves_the_notebooks_values(items, snapshot_only):
    expected = snapshot(items)
    with share_threshold(SHARE):
        back = trip({"nested": [tuple(items)], "flat": items}, snapshot=snapshot_only)
    check_all(back["flat"], items, expected)
    check_all(back["nested"][0], items, expected)
    for i, a in enumerate(items):  # the same object twice is one object in the rank
        for j, b in enumerate(items):
            if a is b:
                assert back["flat"][i] is back["flat"][j] and back["nested"][0][i] is back["flat"][j]
    check_all(items, items, expected)  # the notebook's own values are untouched
    assert sharing.settle(30)


@PROFILE
@given(source=tensors())
def test_views_that_cover_their_storage_stay_aliased_in_the_rank(source):
    base, view = source
    if view.is_conj() or view.is_neg() or type(view) is not torch.Tensor:
        view = base
    with share_threshold(SHARE):
        back = trip([base, view])
    assert same_tensor(back[0], base) and same_tensor(back[1], view)
    if base.untyped_storage().nbytes() >= SHARE:  # shared by memory: one storage in the rank as in the notebook
        assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()


def test_the_issues_case_conjugates_and_column_blocks_each_arrive_with_their_own_values():
    ts = [torch.randn(512, 512, dtype=torch.complex64).conj() for _ in range(8)]
    big = np.arange(4096 * 4096, dtype=np.float32).reshape(4096, 4096)
    arrs = [big[:, i * 500:(i + 1) * 500] for i in range(4)]
    back_ts, back_arrs = trip((ts, arrs))
    assert [torch.equal(a, b) for a, b in zip(ts, back_ts)] == [True] * 8
    assert [np.array_equal(a, b) for a, b in zip(arrs, back_arrs)] == [True] * 4


@PROFILE
@given(items=payloads())
def test_export_delivers_every_element(items, tmp_path_factory):
    expected = snapshot(items)
    script = str(tmp_path_factory.mktemp("export") / "job.py")
    task = payload.CallTask(len, (items,), {}, False, payload.Sources())
    with share_threshold(SHARE):
        exported = exporting.write(task, script)
    with open(exported.payload, "rb") as f:
        run = pickle.load(f)
    with sharing.loading():  # as an exported rank loads it (runner.py)
        if run["arrays"]:
            sharing.map_export_arrays(os.path.join(os.path.dirname(script), run["arrays"]))
        back = pickle.loads(run["task"]).args[0]
    check_all(back, items, expected)
    check_all(items, items, expected)


@PROFILE
@given(items=payloads())
def test_return_values_arrive_exactly_and_the_ranks_objects_are_left_alone(items):
    expected = snapshot(items)
    model = torch.nn.Linear(3, 2)
    weight = model.weight
    back = pickle.loads(payload.dumps_result({"items": items, "model": model}))
    check_all(back["items"], items, expected)
    assert model.weight is weight and same_tensor(back["model"].weight, weight)


@PROFILE
@given(sources=st.lists(tensors(), min_size=1, max_size=3))
def test_checkpoints_keep_every_element(sources, tmp_path_factory):
    model, fresh = torch.nn.Module(), torch.nn.Module()
    for i, (_, view) in enumerate(sources):
        value = view.detach()
        model.register_buffer(f"b{i}", value)
        fresh.register_buffer(f"b{i}", torch.zeros(value.shape, dtype=value.dtype))
    path = str(tmp_path_factory.mktemp("ckpt") / "model.pt")
    checkpoint.save_checkpoint(path, model)
    checkpoint.load_checkpoint(path, fresh)
    for i, (_, view) in enumerate(sources):
        assert same_tensor(getattr(fresh, f"b{i}"), view.detach().resolve_conj().resolve_neg()), f"buffer {i}"
