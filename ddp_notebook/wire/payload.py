"""What crosses from the notebook to the ranks.

A task is built in the notebook, pickled once with cloudpickle, sent to every
rank in its message (a small task) or written once into the job's private
directory (a big one), and loaded by every rank, which calls ``task.run(ctx)``.
Notebook-defined functions and classes travel by value, so nothing has to be
importable from ``__main__`` in the ranks.  Rank side: no IPython here.
"""
from __future__ import annotations

import __future__
import builtins
import functools
import io
import linecache
import operator
import os
import pickle
import sys
import threading
import types
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import cloudpickle

from . import sharing
from .errors import LaunchError, TrainingStopped

RANK_NAMES = ("rank", "local_rank", "world_size", "device")


_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, name).compiler_flag
                                                 for name in __future__.all_feature_names))

# Every cell source installed in this process (its linecache entry) and its label ("Cell In[3]"), for its
# tracebacks: a warm pool's rank is sent a cell's source once, and later tasks refer to it.
_installed_sources: dict[str, tuple] = {}
_installed_labels: dict[str, str] = {}


def future_features(compiler_flags: int) -> int:
    """The ``from __future__`` features among a compiler's flags (IPython keeps a cell's for the cells after it)."""
    return compiler_flags & _FUTURE_FLAGS


def traceback_labels() -> dict[str, str]:
    """Rank side, before formatting a traceback: put every cell source this process has installed back into
    linecache where something cleared it (``linecache.clearcache()``: profilers, debuggers), and give their
    labels."""
    for filename, entry in _installed_sources.items():
        linecache.cache.setdefault(filename, entry)
    return _installed_labels


@dataclass
class Sources:
    """Source text of notebook cells, so rank tracebacks show their lines."""

    texts: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def install(self) -> None:
        for filename, text in self.texts.items():
            linecache.cache[filename] = _installed_sources[filename] = (len(text), None, text.splitlines(True),
                                                                        filename)
        _installed_labels.update(self.labels)


@dataclass
class CellTask:
    """Run a notebook cell's code with the notebook names it uses."""

    code: str
    filename: str
    line_offset: int
    names: dict[str, Any]
    returns: list[str]
    sources: Sources
    future_flags: int = 0  # the notebook's ``from __future__`` features (:func:`future_features`)

    def run(self, ctx, namespace: dict | None = None) -> Any:
        self.sources.install()
        # As the notebook compiles the cell: with its __future__ features and none of this module's (dont_inherit);
        # the blank lines give each line its number in the notebook cell.
        compiled = compile("\n" * self.line_offset + self.code, self.filename, "exec", flags=self.future_flags,
                           dont_inherit=True)
        ns = namespace if namespace is not None else {}
        ns.setdefault("__name__", "__main__")
        ns.setdefault("__builtins__", builtins)
        ns.update(self.names)
        ns.update(rank=ctx.rank, local_rank=ctx.local_rank, world_size=ctx.world_size, device=ctx.device)
        try:
            exec(compiled, ns)
        except TrainingStopped:
            pass  # a graceful stop: the names assigned so far are the result
        # (every rank's: a sharded model is gathered by all of them; only rank 0's is sent, see sent_by)
        return CellResult({n: ns[n] for n in self.returns if n in ns},
                          [n for n in self.returns if n not in ns])

    @staticmethod
    def sent_by(rank: int, value: Any) -> Any:
        """What a rank sends back of its result: rank 0's names; the other ranks' only which names they did not
        assign (None: they assigned every one), so that a name only they assigned can be told."""
        if rank == 0:
            return value
        return CellResult({}, value.missing) if value is not None and value.missing else None


@dataclass
class CellResult:
    """What rank 0 sends back for ``--return``: the values, and the names the cell never assigned (the other
    ranks send only those names, see :meth:`CellTask.sent_by`)."""

    values: dict[str, Any]
    missing: list[str]


@dataclass
class CallTask:
    """Call ``fn(*args, **kwargs)``, or ``fn(rank, *args)`` for spawn."""

    fn: Callable
    args: tuple
    kwargs: dict
    pass_rank: bool
    sources: Sources

    def run(self, ctx, namespace: dict | None = None) -> Any:
        self.sources.install()
        try:
            if self.pass_rank:
                return self.fn(ctx.rank, *self.args, **self.kwargs)
            return self.fn(*self.args, **self.kwargs)
        except TrainingStopped:
            return None  # a graceful stop ended the function before it returned

    @staticmethod
    def sent_by(rank: int, value: Any) -> Any:
        """What a rank sends back of its result: every rank's return value."""
        return value


_WRAPPER_CLASSES = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")  # (.module inside)


def unwrap_model(model: Any) -> Any:
    """The plain module inside DDP / DataParallel / FSDP / ``torch.compile`` wrappers, in any nesting."""
    torch = sys.modules.get("torch")
    if torch is None:
        return model
    while True:
        if type(model).__name__ in _WRAPPER_CLASSES and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(model, torch.nn.Module) and isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def result_store(into: tuple[int, int] | None) -> sharing.Store | None:
    """Rank side: where the big tensors of a rank's result go, made before the result is (a sharded value's whole
    copies are gathered straight into it: ``Store.new_tensor``); ``into`` as for :func:`dumps_result`."""
    return sharing.Store(results_into=into) if into is not None else None


def dumps_result(value: Any, whole: Sequence[tuple[Any, Any]] = (), into: tuple[int, int] | None = None,
                 store: sharing.Store | None = None) -> Payload:
    """Rank side: pickle what a rank returns to the notebook.

    Wrapped models travel as the plain module, tensors on a device as CPU
    copies and results of a computation detached, wherever they sit (a state dict, an optimizer, a dataclass); the
    rank's own objects are left as they are, so a warm pool's model stays on its
    GPU.  Objects that share a tensor (a model and its optimizer) still share it.

    ``whole``: the sharded objects of ``value`` and their whole copies, in the order every rank found them
    (``rank.sharded.whole_copies``).  Rank 0 sends the copies; another rank, whose copy is None, sends a
    reference to rank 0's (:func:`joined_results` puts rank 0's object there in the notebook).  A sharded object
    that is not among them is refused.

    ``into`` (a rank of the notebook's host): the notebook's results file for this rank (its pid and descriptor,
    ``sharing.results_file``); big tensors and arrays are copied into it, and the notebook maps them as it loads the
    result (:func:`loads`); or ``store``, the :func:`result_store` the whole copies were made in.  Release the
    returned payload (:func:`release`) once it is sent.
    """
    if not whole and (value is None or type(value) is CellResult and not value.values):  # most cells
        return Payload(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    replacements = {id(original): _OnRankZero(index) if copy is None else copy
                    for index, (original, copy) in enumerate(whole)}
    if whole:
        copies = [copy for _, copy in whole]
        value = GatheredResult(value, None if any(copy is None for copy in copies) else copies)
    if store is None:
        store = result_store(into)
    buffer = io.BytesIO()
    try:
        _ResultPickler(buffer, replacements, store, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except BaseException:
        if store is not None:
            store.bundle.release()
        raise
    data = Payload(buffer.getvalue())
    data.shared = store.bundle if store is not None else None
    return data


@dataclass
class GatheredResult:
    """A rank's result that holds sharded objects: rank 0's with their whole copies in the order gathered
    (``whole``), another rank's with references to them (``whole`` None)."""

    value: Any
    whole: list | None


@dataclass(frozen=True)
class _OnRankZero:
    """Stands for rank 0's whole copy of the ``index``-th sharded object in another rank's result."""

    index: int


def joined_results(results: list) -> list:
    """Notebook side: the ranks' results (rank 0's first) with sharded objects whole: rank 0's copies, which the
    other ranks' results refer to (one object in the notebook, as the ranks' full tensors are one)."""
    if not results or not isinstance(results[0], GatheredResult):
        return results
    whole = results[0].whole
    return [results[0].value] + [_with_rank_zeros(r.value, whole) if isinstance(r, GatheredResult) else r
                                 for r in results[1:]]


def _with_rank_zeros(value: Any, whole: list) -> Any:
    """``value`` with each _OnRankZero in it replaced by rank 0's object (pickled again, which finds them anywhere)."""
    class Referring(cloudpickle.Pickler):
        def persistent_id(self, obj):
            return obj.index if type(obj) is _OnRankZero else None

    class Resolving(pickle.Unpickler):
        def persistent_load(self, index):
            return whole[index]

    buffer = io.BytesIO()
    Referring(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    buffer.seek(0)
    return Resolving(buffer).load()


class _ResultPickler(cloudpickle.Pickler):
    def __init__(self, file, replacements: Mapping[int, Any], store: sharing.Store | None = None, protocol=None):
        super().__init__(file, protocol=protocol)
        self._replacements = replacements
        self._store = store

    def reducer_override(self, obj):
        replacement = self._replacements.get(id(obj), self)
        if replacement is not self:
            return _same, (replacement,)
        torch = sys.modules.get("torch")
        if torch is not None:
            if type(obj) is torch.Tensor and (obj.grad_fn is not None or obj.device.type not in ("cpu", "meta")):
                # (a result of a computation comes back detached: its graph cannot travel)
                return _same, (obj.detach().to("cpu").requires_grad_(obj.requires_grad and obj.grad_fn is None),)
            if isinstance(obj, torch.nn.Module):
                if type(obj).__name__ == "FullyShardedDataParallel":
                    raise TypeError(_SHARDED_ELSEWHERE.format(what="an FSDP1 model (FullyShardedDataParallel)"))
                plain = unwrap_model(obj)
                if plain is not obj:
                    return _same, (plain,)
            dtensor = sys.modules.get("torch.distributed.tensor")
            if dtensor is not None and isinstance(obj, dtensor.DTensor):
                raise TypeError(_SHARDED_ELSEWHERE.format(what="a DTensor"))
        if self._store is not None:
            reduced = self._store.reduce(obj)  # (a detached CPU tensor by now: device tensors were copied above)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)


_SHARDED_ELSEWHERE = ("the result holds {what} where the ranks do not look for sharded values to gather (in a "
                      "dict, list, tuple or an object's attributes, or a module's parameters): return it there, "
                      "or its full_tensor()")


def _same(value: Any) -> Any:
    return value


# The notebook's open files: cloudpickle would send an open text file as a StringIO of its contents (the whole file, in
# the payload) and the rank's writes would reach nothing; every pickler of notebook values refuses them at once,
# unread (the payload's, the warm pool's fingerprint).
_FILE_TYPES = (io.FileIO, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.BufferedRWPair, io.TextIOWrapper)
_STANDARD_STREAMS = {"stdout": ("stdout", "__stdout__"), "stderr": ("stderr", "__stderr__")}


def _refuse_file(file):
    for stream, names in _STANDARD_STREAMS.items():
        if any(file is getattr(sys, name, None) for name in names):
            return getattr, (sys, stream)  # the rank's own, whose output reaches the cell
    raise pickle.PicklingError(f"{_process_own(file).label} cannot be sent")


def with_files_refused(table: Mapping, own: Mapping | None = None) -> ChainMap:
    """A pickler's dispatch ``table`` with ``own`` reducers, where an open (or closed) file fails to pickle and a
    standard stream becomes the rank's own.  As flat as ``table``: every object a pickler pickles by its reduce
    misses these maps, and each level of ChainMap costs it a microsecond."""
    maps = list(table.maps) if isinstance(table, ChainMap) else [table]
    return ChainMap({**maps[0], **dict.fromkeys(_FILE_TYPES, _refuse_file), **(own or {})}, *maps[1:])


# Other things that are the notebook process's own (module, class, what it is, how a rank gets its own): these fail
# to pickle anyway; a refusal names them for what they are (a Popen fails on its lock, which is not the culprit).
_PROCESS_OWN = (("socket", "socket", "socket", "open"), ("subprocess", "Popen", "process", "start"),
                ("sqlite3", "Connection", "sqlite3 connection", "open"),
                ("sqlite3", "Cursor", "sqlite3 cursor", "open"))


@dataclass
class _ProcessOwn:
    """A value that is the notebook process's own (see :func:`_process_own`)."""

    kind: str  # "open file", "closed file", "socket", "process", ...
    label: str  # the kind and which one: "open file 'run.log'", "process 4242"
    verb: str  # how a rank gets its own: "open", "start"

    @property
    def why(self) -> str:
        if self.kind == "open file":
            return "a file the notebook opened is its own: a rank would get a copy of its contents, and its writes " \
                   "would reach no file"
        if self.kind == "closed file":
            return "a closed file is of no use to a rank"
        if self.kind == "process":
            return "a process the notebook started is the notebook's child: a rank can neither wait for it nor stop it"
        return f"a {self.kind} is the notebook process's own: a rank cannot use it"


def _process_own(value: Any) -> _ProcessOwn | None:
    """What ``value`` is, if it is the notebook process's own (an open file, a socket, a process, a database
    connection); None for anything else."""
    if isinstance(value, _FILE_TYPES):
        kind = "closed file" if value.closed else "open file"
        name = getattr(value, "name", None)
        which = f" {name!r}" if isinstance(name, str) else f" (descriptor {name})" if isinstance(name, int) else ""
        return _ProcessOwn(kind, kind + which, "open")
    for module_name, class_name, kind, verb in _PROCESS_OWN:
        module = sys.modules.get(module_name)  # (not imported here: a value of the class means it was)
        if module is not None and isinstance(value, getattr(module, class_name)):
            pid = getattr(value, "pid", None)
            return _ProcessOwn(kind, f"{kind} {pid}" if isinstance(pid, int) else kind, verb)
    return None


def _code_reduce_keeping_filename(code: types.CodeType):
    # cloudpickle >= 3.1 replaces co_filename with "<dynamic-code>"; the ranks
    # need the real one so tracebacks can show the notebook cell's lines.
    constructor, args = cloudpickle.cloudpickle._code_reduce(code)
    return constructor, tuple(code.co_filename if a == "<dynamic-code>" else a for a in args)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = with_files_refused(cloudpickle.Pickler.dispatch_table,
                                        {types.CodeType: _code_reduce_keeping_filename})

    def __init__(self, file, protocol=None, store: sharing.Store | None = None):
        super().__init__(file, protocol=protocol)
        self._store = store

    def reducer_override(self, obj):
        # Big tensors and arrays, wherever they sit, travel by shared memory (sharing.py).
        if self._store is not None:
            reduced = self._store.reduce(obj)
            if reduced is not None:
                return reduced
        torch = sys.modules.get("torch")
        if torch is not None and type(obj) is torch.Tensor and obj.device.type not in ("cpu", "meta"):
            # torch would tag it with the notebook's device index: it lands on each rank's own device instead
            return sharing.on_rank_device, (obj.detach().to("cpu").requires_grad_(obj.requires_grad),
                                            obj.device.type)
        return super().reducer_override(obj)


class Payload(bytes):
    """The pickled task; ``shared`` holds the shared buffers its big arrays live in until ``release``."""

    shared: sharing.Bundle | None = None


def dumps_with(obj: Any, store: sharing.Store | None = None) -> bytes:
    """Pickle ``obj`` as a payload, its big arrays placed by ``store`` (an export's, say)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL, store=store).dump(obj)
    return buffer.getvalue()


def dumps(task: Any, share: bool = True, snapshot: bool = False) -> Payload:
    """Pickle the task once (big arrays into shared memory); if that fails, find and name the culprit.

    ``snapshot=True`` (jobs that run while the notebook goes on working): big arrays are copied, never moved,
    so the ranks see them as they are now and the notebook's later writes are its own.
    """
    if type(task) is CellTask and not task.names:  # nothing but text: plain pickle says the same, sooner
        try:
            return Payload(pickle.dumps(task, protocol=pickle.HIGHEST_PROTOCOL))
        except Exception:
            pass  # (cloudpickle below, and its diagnosis)
    store = sharing.Store(move=not snapshot) if share else None
    try:
        data = Payload(dumps_with(task, store))
        data.shared = store.bundle if store is not None else None
        return data
    except Exception:
        if store is not None:
            store.bundle.release()
    if isinstance(task, CellTask):
        parts = dict(task.names)
    elif isinstance(task, CallTask):
        name = getattr(task.fn, "__name__", "")
        parts = {name if name.isidentifier() else "fn": task.fn}
        parts.update({f"args[{i}]": a for i, a in enumerate(task.args)})
        parts.update({f"kwargs[{k!r}]": v for k, v in task.kwargs.items()})
    else:
        parts = {"the task": task}
    for name, value in parts.items():
        error = _pickling_error(value)
        if error is not None:
            raise LaunchError(_refusal(name, *_culprit(value, error))) from None
    raise LaunchError("cannot pickle what the ranks need; no rank was started")


def _refusal(name: str, steps: str, value: Any, error: Exception) -> str:
    subject = name + steps
    subject = f"'{subject}'" if subject.isidentifier() else subject  # a path reads as code: holder['lock'], args[0].f
    own = _process_own(value)
    if own is None:
        return (f"cannot send {subject} ({type(value).__name__}) to the ranks: {type(error).__name__}: {error}\n"
                f"Create it inside the cell (or the function) instead, so each rank makes its own. "
                f"No rank was started.")
    return (f"cannot send {subject} ({own.label}) to the ranks: {own.why}.\n"
            f"{own.verb.capitalize()} it inside the cell (or the function) instead, so each rank {own.verb}s its own. "
            f"No rank was started.")


def _pickling_error(value: Any) -> Exception | None:
    """Why ``value`` cannot be pickled as a payload would pickle it (nothing is shared); None if it can."""
    try:
        dumps_with(value, sharing.Store(dry=True))
    except Exception as exc:
        return exc
    return None


def _culprit(value: Any, error: Exception) -> tuple[str, Any, Exception]:
    """The innermost part of ``value`` (whose pickling failed with ``error``) that fails to pickle on its own, the
    steps that reach it from ``value`` (``['lock']``, ``.f``, ``[2]``: "" for ``value`` itself) and its error."""
    steps, on_path = "", set()
    while _process_own(value) is None:  # (a Popen fails on its lock: the process is named)
        on_path.add(id(value))
        found = _first_failing([(step, part) for step, part in _parts(value) if id(part) not in on_path])
        if found is None:
            break
        step, value, error = found
        steps += step
    return steps, value, error


def _first_failing(parts: list[tuple[str, Any]]) -> tuple[str, Any, Exception] | None:
    """The first of ``parts`` that fails to pickle on its own, and its error.  Halves are pickled together: a list of
    a million items takes some twenty tries, not a million."""
    low, high = 0, len(parts)
    while high - low > 1:
        middle = (low + high) // 2
        if _pickling_error([part for _, part in parts[low:middle]]) is not None:
            high = middle
        else:
            low = middle
    if low < high:
        step, part = parts[low]
        error = _pickling_error(part)
        if error is not None:
            return step, part, error
    return None


def _parts(value: Any) -> list[tuple[str, Any]]:
    """What pickling ``value`` pickles besides it, each with the step that reaches it (``['key']``, ``[2]``,
    ``.name``)."""
    if isinstance(value, dict):
        return [(f"[{key!r}]", item) for key, item in value.items()]
    if isinstance(value, tuple) and isinstance(getattr(type(value), "_fields", None), tuple):  # a named tuple
        return [(f".{name}", item) for name, item in zip(value._fields, value)]
    if isinstance(value, (list, tuple)):
        return [(f"[{i}]", item) for i, item in enumerate(value)]
    if isinstance(value, types.MethodType):
        return [(".__self__", value.__self__), (".__func__", value.__func__)]
    if isinstance(value, types.FunctionType):
        return _function_parts(value)
    parts = []
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, (dict, types.MappingProxyType)):  # an object's, or a class's the notebook defined
        for name, item in attributes.items():
            if isinstance(value, type) and name.startswith("__") and name.endswith("__"):
                continue
            if isinstance(item, dict) and not isinstance(value, type):
                # an attribute kept in a dict of the object (a torch Module's _modules): named as the attribute
                parts += [(f".{key}", sub) for key, sub in item.items()
                          if isinstance(key, str) and key.isidentifier() and _attribute_is(value, key, sub)]
            parts.append((f".{name}", item))
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(value, slot):
                parts.append((f".{slot}", getattr(value, slot)))
    return parts


def _attribute_is(value: Any, name: str, part: Any) -> bool:
    try:
        return getattr(value, name) is part
    except Exception:
        return False


def _function_parts(fn: types.FunctionType) -> list[tuple[str, Any]]:
    """The globals a function's code reads, its closure's values and its defaults (cloudpickle pickles them with a
    function it pickles by value)."""
    names, codes = {}, [fn.__code__]
    while codes:
        code = codes.pop(0)
        names.update(dict.fromkeys(code.co_names))
        codes += [const for const in code.co_consts if isinstance(const, types.CodeType)]
    parts = [(f".__globals__[{name!r}]", fn.__globals__[name]) for name in names if name in fn.__globals__]
    for i, cell in enumerate(fn.__closure__ or ()):
        try:
            parts.append((f".__closure__[{i}].cell_contents", cell.cell_contents))
        except ValueError:
            pass  # (an empty cell)
    parts += [(f".__defaults__[{i}]", default) for i, default in enumerate(fn.__defaults__ or ())]
    parts += [(f".__kwdefaults__[{name!r}]", default) for name, default in (fn.__kwdefaults__ or {}).items()]
    return parts


def release(data: Any) -> None:
    """The job is over: let go of the shared buffers of its payload (ranks keep what they mapped)."""
    bundle = getattr(data, "shared", None)
    if bundle is not None:
        bundle.release()


# Cells whose code IPython holds transformed (a %%ddp cell is a call of the magic), as their user wrote them.
_written_texts: dict[str, str] = {}

# Notebook side: IPython's cells as the ranks get them, each read once (a cell's file never changes), in the order
# read or last changed, with the version of that change.  A warm pool asks only for what changed since it last
# shipped (sources_since), so a session's thousandth cell costs what its first did.
_cells = Sources()
_cell_versions: dict[str, int] = {}  # every cell file seen, text or not
_version = 0
_cells_counted = 0  # the shell's execution count at the last read
_cells_lock = threading.RLock()  # (a background job's thread reads them too)
SOURCES_BUDGET = 4 << 20  # bytes of cell text a task carries at most: what does not fit goes with later tasks


def cell_label(number: int) -> str:
    """How IPython names a cell in tracebacks: "Cell In[7]"."""
    return f"Cell In[{number}]"


def _set_cell(filename: str, text: str, label: str | None) -> None:
    global _version
    if _cells.texts.get(filename) == text and _cells.labels.get(filename) == label:
        return
    _version += 1
    _cells.texts.pop(filename, None)  # (to the end: the order of versions)
    _cells.texts[filename] = text
    _cells.labels.pop(filename, None)
    if label is not None:
        _cells.labels[filename] = label
    _cell_versions[filename] = _version


def _no_cells() -> tuple[dict[str, int], int]:
    return {}, 0


# The notebook side's reading of which cells IPython compiled (notebook/ipython_cells.py): file -> execution count,
# and the execution count now.  Installed by the front doors (api.py); none outside them.
_ipython_cells: Callable[[], tuple[dict[str, int], int]] = _no_cells


def read_cells_with(cell_files: Callable[[], tuple[dict[str, int], int]]) -> None:
    """Install what tells which cells IPython compiled (the notebook side's ``ipython_cells.cell_files``)."""
    global _ipython_cells
    _ipython_cells = cell_files


def _read_new_cells() -> None:
    """Read the cells IPython compiled since the last call: its map of cell files only grows, so walk it from its
    newest entry back to the first one seen before."""
    global _cells_counted
    filename_map, count = _ipython_cells()
    new = []
    for filename in reversed(filename_map):
        if filename in _cell_versions:
            break
        new.append(filename)
    for filename in reversed(new):
        _cell_versions.setdefault(filename, 0)
        entry = linecache.cache.get(filename)
        text = _written_texts.get(filename) or ("".join(entry[2]) if entry is not None and len(entry) == 4 else "")
        if text:
            _set_cell(filename, text, cell_label(filename_map[filename]))
    if len(new) < count - _cells_counted:  # a cell ran again: its file (named by its code) has a new number
        for filename, number in list(filename_map.items()):
            if filename in _cells.texts:
                _set_cell(filename, _cells.texts[filename], cell_label(number))
    _cells_counted = max(_cells_counted, count)


def hold_cell_text(filename: str, text: str, label: str | None = None) -> None:
    """Notebook side: the cell IPython compiled as ``filename`` (``label``: "Cell In[7]") was written as ``text``
    (its lines are the ones the ranks compile): tracebacks show it, in this task and later ones."""
    with _cells_lock:
        _written_texts[filename] = text
        _read_new_cells()
        if filename in _cell_versions:
            _set_cell(filename, text, label or _cells.labels.get(filename))


def _within_budget(filenames) -> tuple[Sources, int]:
    """The cells of ``filenames`` (in the order of their versions) up to :data:`SOURCES_BUDGET`, and the version up
    to which every cell was either taken or too big to take ever."""
    sources, budget, reached = Sources(), SOURCES_BUDGET, 0
    for filename in filenames:
        text = _cells.texts[filename]
        if len(text) <= SOURCES_BUDGET:
            if len(text) > budget:
                break  # later tasks take it
            budget -= len(text)
            sources.texts[filename] = text
            if filename in _cells.labels:
                sources.labels[filename] = _cells.labels[filename]
        reached = _cell_versions[filename]
    return sources, reached


def notebook_sources(extra_files: set[str] = frozenset()) -> Sources:
    """IPython's cells as their user wrote them, with IPython's labels (up to :data:`SOURCES_BUDGET` of text, the
    oldest first); and the in-memory sources of ``extra_files`` (a function's own file)."""
    sources = sources_since(0)[0]
    for filename in extra_files:
        entry = linecache.cache.get(filename)
        if filename not in sources.texts and entry is not None and len(entry) == 4:
            sources.texts[filename] = _written_texts.get(filename) or "".join(entry[2])
    return sources


def sources_since(version: int) -> tuple[Sources, int]:
    """The cells read or changed after ``version`` (0: from the first), up to :data:`SOURCES_BUDGET`, and the
    version a reader that installs them has every cell up to."""
    with _cells_lock:
        _read_new_cells()
        changed = []
        for filename in reversed(_cells.texts):  # newest change first: stop at the first the reader holds
            if _cell_versions[filename] <= version:
                break
            changed.append(filename)
        changed.reverse()
        sources, reached = _within_budget(changed)
        return sources, max(version, reached)


def cell_labels() -> dict[str, str]:
    """IPython's label of each cell file ("Cell In[7]"), from any thread."""
    return {filename: cell_label(number) for filename, number in list(_ipython_cells()[0].items())}


def sources_for(fn: Callable) -> Sources:
    """The cell sources a function's tracebacks may need (its own file, if it lives in memory)."""
    code = getattr(fn, "__code__", None)
    return notebook_sources({code.co_filename} if code else set())


INLINE_BYTES = 256 << 10


def for_ranks(task: Any, directory: str, name: str = "task.pkl") -> dict:
    """How the ranks get a dumped task: in their RUN message when it is small (``{"data": ...}``: no file to
    write, read and remove), else written once to a file every rank reads (``{"path": ...}``, see :func:`write`)."""
    if isinstance(task, bytes) and len(task) <= INLINE_BYTES:
        return {"data": bytes(task)}
    return {"path": write(task, directory, name)}


def write(task: Any, directory: str, name: str = "task.pkl") -> str:
    """Write the task to an owner-only file in the job's private directory.

    Pass what ``dumps`` returned, and keep it until the job ends: its shared buffers live as long as it
    does.  A task not dumped yet is pickled whole, big arrays included.
    """
    data = task if isinstance(task, bytes) else dumps(task, share=False)
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def load(path: str) -> Any:
    with open(path, "rb") as f, sharing.loading():
        return pickle.load(f)


def loads(data: bytes) -> Any:
    """A task sent in its message rather than in a file (a small one: see ``Job``), or a rank's result, its big
    arrays mapped from the shared memory they name."""
    with sharing.loading():
        return pickle.loads(data)
