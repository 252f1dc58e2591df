"""Checkpoints that do not care how the model is wrapped.

``save_checkpoint`` writes the plain module's weights (no ``module.`` or
``_orig_mod.`` prefixes) from rank 0 only, atomically, and without any
collective, so calling it under ``if rank == 0:`` cannot hang.  Every rank that
calls it leaves its own RNG state in a small file beside the checkpoint.
A sharded model (FSDP2 ``fully_shard``, DTensor parameters) is saved by every
rank at once through ``torch.distributed.checkpoint`` into a directory, each
rank writing its own shards; such a save or load is a collective that refuses,
within seconds, a call that not every rank makes.
``load_checkpoint`` loads into a plain, DDP-wrapped or ``torch.compile``d
model alike (also files saved the naive way, with prefixed keys) using
``torch.load(weights_only=True)``, and brings back what a resumed run needs.
``BestCheckpoint`` keeps the best ``keep`` checkpoints by a monitored score.
"""
from __future__ import annotations

import contextlib
import errno
import io
import itertools
import json
import os
import random
import secrets
import stat
import sys
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from . import background_saves, context, rendezvous
from .background_saves import BackgroundSaveError, StagingMemoryError  # noqa: F401 - ddp_notebook's names
from .data import rank_and_world_size
from ..wire import protocol, safe_files
from ..wire.payload import unwrap_model

FORMAT = "ddp_notebook.checkpoint/1"
RNG_FORMAT = "ddp_notebook.rng/1"  # a rank's RNG state in a sharded checkpoint's save folder
RNG_SAVES_FORMAT = "ddp_notebook.rng_saves/1"  # a rank's RNG file beside a one-file checkpoint (RNG_FORMAT: read)
RNG_SAVES_KEPT = 3  # a rank's RNG file keeps its last saves' states: the model file may still name an older one
# Test hook: after the temporary file is written and fsynced, write this file and wait before the rename.
PAUSE_BEFORE_RENAME_ENV = "DDP_NOTEBOOK_TEST_PAUSE_BEFORE_RENAME"
SHARDED_FORMAT = "ddp_notebook.sharded_checkpoint/1"
SHARDED_INDEX = "checkpoint.json"  # in a sharded checkpoint's directory: names its one complete save
SHARDED_META = "meta.pt"  # in each save's folder: epoch, sampler epoch, world size, extra values
SAVE_FOLDER_PREFIX = "save-"  # each sharded save's own folder; the only folders a save ever removes
ARRIVAL_TIMEOUT_ENV = "DDP_NOTEBOOK_CHECKPOINT_ARRIVAL_S"
ARRIVAL_TIMEOUT_S = 10.0

_save_counts: dict[str, int] = {}
_rng_saves: dict[str, list[tuple[str, dict]]] = {}  # rng_path -> this rank's latest (tag, state), oldest first
_meetings: dict[tuple[str, str], int] = {}
_background_group: tuple[Any, Any] | None = None  # (the default process group, the gloo group background saves use)
_last_sharded_background: str | None = None  # the path of this rank's latest background save of a sharded model


class ResumeWarning(UserWarning):
    """A checkpoint was loaded, but something a faithful resume needs was missing."""


# -- state dict keys ------------------------------------------------------------------------------

def _strip(key: str, leading: int = 0) -> str:
    """``key`` without ``_orig_mod`` components and without ``leading`` leading components."""
    parts = [p for p in key.split(".") if p != "_orig_mod"] if key else []
    return ".".join(parts[leading:])


def _translate(state: Mapping[str, Any], rename) -> "OrderedDict[str, Any]":
    """Rename the keys of a state dict, and of its ``_metadata`` (module versions) alike."""
    renamed = OrderedDict((rename(k), v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        # Deeper entries come later and win: DDP's "module" entry becomes the plain model's "".
        renamed._metadata = OrderedDict((rename(k), v) for k, v in metadata.items())
    return renamed


def _rename(state: Mapping[str, Any], leading: int) -> "OrderedDict[str, Any]":
    """Drop every ``_orig_mod`` component and ``leading`` leading ``module`` components."""
    return _translate(state, lambda key: _strip(key, leading))


def _leading_module_components(keys: Sequence[str]) -> int:
    """How many leading ``module.`` components every key shares (DDP wrapping, possibly nested)."""
    split = [[p for p in k.split(".") if p != "_orig_mod"] for k in keys]
    count = 0
    while split and all(len(parts) > count + 1 and parts[count] == "module" for parts in split):
        count += 1
    return count


def clean_state_dict(state_dict: Mapping[str, Any],
                     expected_keys: Sequence[str] | None = None) -> "OrderedDict[str, Any]":
    """A state dict with the ``module.`` (DDP) and ``_orig_mod.`` (torch.compile) prefixes removed.

    ``_orig_mod`` components go wherever they are; leading ``module.``
    components go when every key has them.  Given the keys the target model
    expects, only as many ``module.`` components are removed as make the keys
    match (a plain model may own a submodule that is really called ``module``).
    """
    keys = list(state_dict)
    most = _leading_module_components(keys)
    if expected_keys is not None:
        wanted = set(expected_keys)
        for leading in range(most + 1):
            if {_strip(k, leading) for k in keys} == wanted:
                return _rename(state_dict, leading)
    return _rename(state_dict, most)


def _model_state(model: torch.nn.Module) -> "OrderedDict[str, Any]":
    return _rename(unwrap_model(model).state_dict(), 0)


# -- what weights_only loading accepts ----------------------------------------------------------

def _plain(value: Any) -> Any:
    """numpy values as Python numbers or tensors, so ``torch.load(weights_only=True)`` takes them."""
    module = type(value).__module__
    if module == "numpy" or module.startswith("numpy."):
        import numpy as np

        if isinstance(value, np.ndarray):
            return torch.from_numpy(value.copy())
        if isinstance(value, np.generic):
            return value.item()
    if isinstance(value, dict):
        converted = {k: _plain(v) for k, v in value.items()}
        return OrderedDict(converted) if isinstance(value, OrderedDict) else converted
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


def _loads_weights_only(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _skeleton(value: Any) -> Any:
    """The value with tensors replaced by None: what is left to check is cheap to pickle."""
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return type(value)((k, _skeleton(v)) for k, v in value.items()) if type(value) in (dict, OrderedDict) \
            else value
    if type(value) in (list, tuple):
        return type(value)(_skeleton(v) for v in value)
    return value


def _check_weights_only(values: Mapping[str, Any], what: str) -> None:
    """Refuse, before anything is written, values that ``torch.load(weights_only=True)`` would reject."""
    def round_trip(obj: Any) -> None:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        _loads_weights_only(buffer.getvalue())

    values = {k: _skeleton(v) for k, v in values.items()}
    try:
        round_trip(values)
        return
    except Exception:  # noqa: BLE001 - find the culprit below
        pass
    for key, value in values.items():
        try:
            round_trip({key: value})
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"{what} {key!r} ({type(value).__name__}) cannot be loaded back with "
                            f"torch.load(weights_only=True); store numbers, strings, tensors, lists or dicts "
                            f"instead. ({type(exc).__name__})") from None
    raise TypeError(f"{what} cannot be loaded back with torch.load(weights_only=True)")


# -- atomic files -----------------------------------------------------------------------------

def _pause_before_rename(temp: str, path: str) -> None:
    signal_file = os.environ.get(PAUSE_BEFORE_RENAME_ENV)
    if not signal_file:
        return
    size = os.path.getsize(temp)
    note = json.dumps({"pid": os.getpid(), "temp": temp, "path": path, "size": size})
    with open(signal_file + ".part", "w") as f:
        f.write(note)
    os.replace(signal_file + ".part", signal_file)
    deadline = time.monotonic() + 120
    while os.path.exists(signal_file) and time.monotonic() < deadline:
        time.sleep(0.02)  # the test kills us here, or removes the file to let the rename happen


def _atomic_save(obj: Any, path: str, file_mode: int, test_hook: bool = False) -> None:
    """Write to a new temporary file (``O_EXCL``, a random name: never through a link another user planted),
    flush, fsync, then rename over ``path``: readers see old or new, never half.  The file gets ``file_mode``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with safe_files.replace_atomically(path, file_mode,
                                           (lambda temp: _pause_before_rename(temp, path)) if test_hook else None) as f:
            torch.save(obj, f)
    except Exception as exc:
        full = _full_filesystem(exc, obj, path)
        if full is not None:
            raise full from exc
        raise


class _SizeCounter:
    """A file that only counts what is written to it."""

    size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _full_filesystem(exc: Exception, obj: Any, path: str) -> OSError | None:
    """A clear ENOSPC error when a save failed for want of space; torch's own says ``unexpected pos``."""
    no_space = getattr(exc, "errno", None) == errno.ENOSPC
    if isinstance(exc, OSError) and not no_space:
        return None  # (permissions and the like: their own message is clear)
    try:
        counter = _SizeCounter()
        torch.save(obj, counter)
        stats = os.statvfs(os.path.dirname(path))
    except Exception:
        return None
    free = stats.f_bavail * stats.f_frsize  # measured after the partial file was removed
    if not no_space and counter.size <= free:
        return None
    return OSError(errno.ENOSPC, f"the filesystem of {path} is full: the checkpoint needs "
                                 f"{_size_text(counter.size)}, {_size_text(free)} are free there (the previous "
                                 f"file, if any, is left as it was)")


def _size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


# -- RNG state -------------------------------------------------------------------------------

def rng_path(path: str, rank: int) -> str:
    """Where rank ``rank`` keeps its RNG state for the checkpoint at ``path``."""
    return f"{path}.rank{rank}.rng"


def _save_rng(file: str, rank: int, tag: str, state: dict, file_mode: int) -> None:
    """Write ``file``, this rank's RNG file beside a one-file checkpoint, with ``state`` under ``tag`` and the
    states of this rank's :data:`RNG_SAVES_KEPT` - 1 saves before it.  Each rank renames its file into place on its
    own, before or after rank 0 commits the model file, which names the save it belongs to (``rng_tag``): keeping
    the previous saves' states too, the file has the state of whichever save the model file names, also after a
    crash between the two renames."""
    saves = _rng_saves.get(file)
    if saves is None:  # this process's first save of the path: keep those of an earlier run
        saves = list(_read_rng_file(file, own_only=True).items())
    saves = [(t, s) for t, s in saves if t != tag]
    saves = saves[max(0, len(saves) - RNG_SAVES_KEPT + 1):] + [(tag, state)]
    _atomic_save({"format": RNG_SAVES_FORMAT, "rank": rank, "saves": dict(saves)}, file, file_mode)
    _rng_saves[file] = saves


def _read_rng_file(file: str, own_only: bool = False) -> dict[str, dict]:
    """The RNG states in a rank's RNG file beside a one-file checkpoint, by save tag: {} if there is none, it is
    unreadable or (``own_only``) it is not a plain file of this user's."""
    try:
        fd = safe_files.open_own_file(file, os.O_RDONLY) if own_only else os.open(file, os.O_RDONLY)
        with os.fdopen(fd, "rb") as f:
            saved = torch.load(f, map_location="cpu", weights_only=True)
    except Exception:  # (missing, torn, not a checkpoint's: no state to restore, which a resume reports)
        return {}
    if not isinstance(saved, dict):
        return {}
    if isinstance(saved.get("saves"), dict):
        return saved["saves"]
    if "tag" in saved and "state" in saved:  # one save's, as RNG_FORMAT (versions before RNG_SAVES_FORMAT)
        return {saved["tag"]: saved["state"]}
    return {}


def _job_id() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"]
    if os.environ.get("MASTER_PORT"):
        return f"{os.environ.get('MASTER_ADDR', '')}:{os.environ['MASTER_PORT']}"
    return f"local:{os.getpid()}"


def rng_state() -> dict[str, Any]:
    """This process's Python, numpy, torch and CUDA RNG states, in types weights_only loading accepts."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
                             "numpy": None, "cuda": None}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"].cpu())
    if state.get("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


# -- sharded models ------------------------------------------------------------------------------

def is_sharded(model: torch.nn.Module) -> bool:
    """True when the model's parameters are split across ranks (FSDP2 ``fully_shard``, DTensor parameters, FSDP1):
    its checkpoints are saved and loaded by every rank at once."""
    if "torch.distributed.tensor" in sys.modules:  # no DTensor can exist before it is imported
        from torch.distributed.tensor import DTensor

        if any(isinstance(t, DTensor) for t in itertools.chain(model.parameters(), model.buffers())):
            return True
    return any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())


def _arrival_timeout() -> float:
    return float(os.environ.get(ARRIVAL_TIMEOUT_ENV) or ARRIVAL_TIMEOUT_S)


@dataclass
class _Meeting:
    key: str  # this call's keys in the store
    folder_name: str  # the save folder rank 0 chose


def _meet_every_rank(call: str, path: str) -> _Meeting:
    """Wait (at most the arrival timeout) for every rank to make this call too, else refuse it.

    The meeting is kept in the job's store, not in the process group: a call that only some ranks make (under
    ``if rank == 0:``) is refused before any collective starts, where a collective would hang.
    """
    rank, world_size = rank_and_world_size()
    count = _meetings[(call, path)] = _meetings.get((call, path), 0) + 1
    key = f"ddp_notebook/checkpoint/{call}/{path}/{count}"
    if world_size == 1:
        return _Meeting(key, _new_save_name())
    timeout = _arrival_timeout()
    try:
        names = rendezvous.meet(key, rank, world_size, timeout, value=_new_save_name() if rank == 0 else "")
    except rendezvous.Absent as absent:
        _meetings[(call, path)] -= 1  # so that the next call of every rank meets under one key again
        late = rendezvous.ranks_text(absent.ranks) if absent.ranks else "not every rank"
        raise RuntimeError(
            f"{call}({path!r}) of a sharded model is done by every rank at once, and {late} did not call "
            f"it within {timeout:g} s of rank {rank}: call it on every rank, not under `if rank == 0:` "
            f"(a rank may lag {ARRIVAL_TIMEOUT_ENV} seconds). Refused before anything was written or "
            f"read.") from None
    return _Meeting(key, names[0])


def _new_save_name() -> str:
    """A new save folder's name: in time order, and with a random part no other user can guess before it is made."""
    return f"{SAVE_FOLDER_PREFIX}{time.time_ns():x}-{secrets.token_hex(8)}"


def _checkpoint_folder(path: str, file_mode: int | None) -> None:
    """Make a sharded checkpoint's folder (``file_mode`` as a folder's mode: 0700 for 0600) unless it is there, or
    (``file_mode`` None) only check what is there: a folder of this user's, or a link to a folder made by this user
    or root; else FileExistsError."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        if file_mode is None:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            safe_files.make_folder(path, safe_files.folder_mode(file_mode))
            return
        except FileExistsError:  # (another rank made it meanwhile, or another user)
            st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and safe_files.is_ours(st) or \
            stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid()) and os.path.isdir(path):
        return
    if stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
        raise FileExistsError(f"{path} is {safe_files.describe(st)}: a checkpoint is saved only into a folder of "
                              f"yours; remove it, or save under another path")
    raise FileExistsError(
        f"{path} is a single-file checkpoint (of a model that is not sharded); a sharded model's checkpoint is "
        f"a directory: save it under another path (the file is left as it is)")


def _save_sharded(path: str, model: torch.nn.Module, optimizer, record: dict, file_mode: int,
                  background: Any = None) -> str:
    """Every rank writes its shards into a new save folder inside the directory ``path``; once all have, rank 0
    makes it the current one (the index file, replaced atomically) and removes the earlier saves.  With a
    ``background`` staging key, the state is staged (a CPU copy) and all of that happens in a thread."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    global _last_sharded_background
    rank, world_size = rank_and_world_size()
    record["extra"] = _plain(record["extra"])
    _check_weights_only(record["extra"], "extra value")
    _checkpoint_folder(path, None)  # (before the meeting, writing nothing: refused on every rank alike)
    if _last_sharded_background is not None:
        # One sharded save in flight at a time, whatever its path: its collectives (in the one group background
        # saves use) then come in the same order on every rank.
        background_saves.wait(_last_sharded_background)
        _last_sharded_background = None
    meeting = _meet_every_rank("save_checkpoint", path)
    folder = os.path.join(path, meeting.folder_name)
    try:
        _checkpoint_folder(path, file_mode)
        safe_files.make_folder(folder, safe_files.folder_mode(file_mode))  # the first rank makes it, private
        record = {**record, "optimizer": optimizer is not None}
        state = {"model": get_model_state_dict(model)}
        if optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        everything = {"rng": rng_state(), "record": record, "state": state}
        if background is not None:
            started = time.perf_counter()
            group = _gloo_group_for_background_saves()
            _every_rank_can_stage(meeting, background, path, everything, group)
            staged = background_saves.stage(background, path, {"record": record, "state": state})
            everything = {**staged, "rng": everything["rng"]}  # (the RNG state is a copy already)
            blocked_s = time.perf_counter() - started
    except BaseException:
        if rank == 0:
            _remove_saves(path, keep=None, only=meeting.folder_name)
        raise

    def write(group: Any = None) -> None:
        try:
            _atomic_save({"format": RNG_FORMAT, "rank": rank, "state": everything["rng"]},
                         os.path.join(folder, f"rank{rank}.rng"), file_mode)
            if rank == 0:
                _atomic_save(everything["record"], os.path.join(folder, SHARDED_META), file_mode)
            # Returns once every rank has written (fsynced) its shards and rank 0 the metadata.
            dcp.save(everything["state"], storage_writer=dcp.FileSystemWriter(folder), process_group=group)
        except BaseException:
            if rank == 0:
                _remove_saves(path, keep=None, only=meeting.folder_name)
            raise
        _commit(path, meeting, file_mode)

    if background is None:
        write()
    else:
        background_saves.start(path, background, lambda: write(group), blocked_s, tell=rank == 0)
        _last_sharded_background = path
    return path


def _every_rank_can_stage(meeting: _Meeting, key: Any, path: str, state: Any, group: Any) -> None:
    """Every rank checks that its staging copy fits, and all learn what the others found: a rank that cannot
    stage refuses on every rank alike (where the others, going on alone, would wait for it in the write's
    collectives).  Every rank is past the meeting, so a flag reduced in ``group`` (the background saves' own,
    idle until this save's write) tells at once; only a refusal's words go through the store."""
    rank, world_size = rank_and_world_size()
    try:
        background_saves.check_fits(key, path, state)
        refusal = ""
    except StagingMemoryError as exc:
        refusal = str(exc)
    if world_size == 1:
        if refusal:
            raise StagingMemoryError(refusal)
        return
    anyone = torch.tensor([1 if refusal else 0], dtype=torch.int32)
    dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=group)
    if not anyone.item():
        return
    store = rendezvous.job_store()
    store.set(f"{meeting.key}/staging/rank{rank}", refusal)
    keys = [f"{meeting.key}/staging/rank{r}" for r in range(world_size)]
    store.wait(keys, dist.constants.default_pg_timeout)
    refused = {r: store.get(k).decode() for r, k in enumerate(keys)}
    refused = {r: text for r, text in refused.items() if text}
    if refused:
        first = min(refused)
        raise StagingMemoryError(f"{rendezvous.ranks_text(sorted(refused)).capitalize()} cannot stage a copy of "
                                 f"its part of the checkpoint, so no rank saves it: rank {first}: {refused[first]}")


def _gloo_group_for_background_saves() -> Any:
    """A gloo group of every rank, for the collectives of sharded saves written in a thread while training goes on
    in the default group (two threads' collectives in one group would interleave).  Made by the first background
    save of a sharded model, which every rank makes."""
    global _background_group
    default = dist.group.WORLD
    if _background_group is None or _background_group[0] is not default:
        _background_group = (default, dist.new_group(backend="gloo"))
    return _background_group[1]


def _commit(path: str, meeting: _Meeting, file_mode: int) -> None:
    """Rank 0 makes the finished save current; every rank returns when it has (or raises what went wrong)."""
    rank, world_size = rank_and_world_size()
    done = f"{meeting.key}/done"
    if rank != 0:
        store = rendezvous.job_store()
        store.wait([done], dist.constants.default_pg_timeout)
        problem = store.get(done).decode()
        if problem:
            raise RuntimeError(f"the new checkpoint {path} was written, but rank 0 could not make it the current "
                               f"one: {problem}")
        return
    problem = ""
    try:
        folder = os.path.join(path, meeting.folder_name)
        _set_file_modes(folder, file_mode)  # (torch.distributed.checkpoint wrote its files with the umask)
        _pause_before_rename(folder, path)
        index = os.path.join(path, SHARDED_INDEX)
        with safe_files.replace_atomically(index, file_mode) as f:
            f.write(json.dumps({"format": SHARDED_FORMAT, "current": meeting.folder_name}).encode())
        _remove_saves(path, keep=meeting.folder_name)
    except BaseException as exc:
        problem = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if world_size > 1:
            rendezvous.job_store().set(done, problem)


def _set_file_modes(folder: str, file_mode: int) -> None:
    """Give every file of this user's in the save folder ``file_mode`` (opened without following links)."""
    fd = safe_files.open_folder(folder)
    try:
        for name in os.listdir(fd):
            try:
                file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
            except OSError:
                continue  # a link (ELOOP): not ours to change
            try:
                st = os.fstat(file)
                if stat.S_ISREG(st.st_mode) and safe_files.is_ours(st):
                    os.fchmod(file, file_mode)
            finally:
                os.close(file)
    finally:
        os.close(fd)


def _remove_saves(path: str | int, keep: str | None, only: str | None = None) -> None:
    """Remove the save folders in the checkpoint's folder ``path`` (or its descriptor) but ``keep`` (earlier saves,
    and saves a crash left unfinished), or the save ``only``; through the folder's descriptor, never following a
    link (a link there is removed itself; another user's folder is left)."""
    try:
        fd = safe_files.open_folder(path) if isinstance(path, str) else os.dup(path)
    except OSError:
        return
    try:
        for name in os.listdir(fd):
            if name.startswith(SAVE_FOLDER_PREFIX) and name != keep and only in (None, name):
                try:
                    safe_files.remove(name, fd)
                except OSError:
                    pass
    finally:
        os.close(fd)


def _current_save(path: str) -> str | None:
    """The folder of the complete save in a sharded checkpoint's directory; None for a single-file checkpoint.
    The index names it by a bare name (``save-…``): a folder, not a link, inside the checkpoint's folder."""
    if not os.path.isdir(path):
        return None
    index_file = os.path.join(path, SHARDED_INDEX)
    try:
        with open(index_file) as f:
            index = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} is a directory with no complete checkpoint in it (no {SHARDED_INDEX}: no "
                                f"save_checkpoint of a sharded model to it has finished)") from None
    except ValueError:
        raise ValueError(f"{index_file} is not a ddp_notebook checkpoint index (not JSON)") from None
    if not isinstance(index, dict) or index.get("format") != SHARDED_FORMAT:
        raise ValueError(f"{index_file} is not a ddp_notebook checkpoint index")
    current = index.get("current")
    if not (isinstance(current, str) and current.startswith(SAVE_FOLDER_PREFIX) and "/" not in current
            and "\0" not in current):  # (so neither absolute, nor "..", nor a path through another folder)
        raise ValueError(f"{index_file} names {current!r} as its current save: not loaded, a save is a folder "
                         f"{SAVE_FOLDER_PREFIX}… inside {path}")
    folder = os.path.join(path, current)
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        raise FileNotFoundError(f"{index_file} names the save {current}, which is not in {path}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{index_file} names the save {current}, which is {safe_files.describe(st)}, not a folder: "
                         f"not loaded")
    return folder


def _has_checkpoint(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, SHARDED_INDEX))


def _load_whole(folder: str) -> dict:
    """Every tensor and value of a sharded save, whole, in this process: no process group needed, no collective."""
    from torch.distributed import checkpoint as dcp

    from .checkpoint_reader import WeightsOnlyReader

    reader = WeightsOnlyReader(folder)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():  # keys as saved: flattened ("model.a.weight")
        if isinstance(item, dcp.metadata.TensorStorageMetadata):
            flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
        else:
            flat[key] = None  # a pickled value: the load puts it in
    # Keys as they are (not flattened again), so that the planner fills in the pickled values of this very dict.
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")  # (no_dist: we know)
        with _first_refusal():
            dcp.load(flat, storage_reader=reader, planner=planner, no_dist=True)
    return _unflatten(flat, metadata.planner_data)


@contextlib.contextmanager
def _first_refusal() -> Iterator[None]:
    """A refused checkpoint as its own one-line error, not inside ``CheckpointException``'s per-rank tracebacks."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .checkpoint_reader import UnsafeCheckpointError

    try:
        yield
    except CheckpointException as exc:
        failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]  # (exception, traceback)
        refused = [f for f in failures if isinstance(f, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def _unflatten(flat: Mapping[str, Any], paths: Mapping[str, Sequence]) -> dict:
    """Nest values by the paths ``torch.distributed.checkpoint`` recorded when it flattened the state dict (a
    list's items have int components)."""
    nested: dict = {}
    for key, value in flat.items():
        path = paths.get(key, (key,)) if paths else (key,)
        node = nested
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value

    def lists(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: lists(v) for k, v in node.items()}
        if items and all(isinstance(k, int) for k in items) and sorted(items) == list(range(len(items))):
            return [items[i] for i in range(len(items))]
        return items

    return lists(nested)


def _load_shards(folder: str, model: torch.nn.Module, optimizer, strict: bool) -> dict | None:
    """Every rank reads its own shards of a sharded save (resharded to this world size); the optimizer's state."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .checkpoint_reader import WeightsOnlyReader

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    reader = WeightsOnlyReader(folder)
    reader.read_metadata()  # (a refused folder raises here, on every rank alike)
    with _first_refusal():
        dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=not strict))
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=strict))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    return state.get("optimizer")


def _load_whole_into_sharded(model: torch.nn.Module, optimizer, state: Mapping[str, Any],
                             optimizer_state: dict | None, strict: bool) -> None:
    """A whole state dict (a single-file checkpoint) into a sharded model: every rank keeps its own shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    expected = [_strip(k) for k in unwrap_model(model).state_dict()]
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, clean_state_dict(state, expected), options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _optimizer_state_by_names(model, optimizer, optimizer_state),
                                 options=options)


def _parameter_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The names in ``model`` of ``optimizer``'s parameters, in the optimizer's order."""
    names = {id(p): _strip(n) for n, p in unwrap_model(model).named_parameters()}
    try:
        return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    except KeyError:
        raise ValueError("the optimizer holds a parameter that is not the model's") from None


def _optimizer_state_by_names(model: torch.nn.Module, optimizer, saved: Mapping[str, Any]) -> dict:
    """``optimizer.state_dict()``'s form (parameters by position) keyed by parameter name instead, the form of
    ``get_optimizer_state_dict``; positions are matched as ``optimizer.load_state_dict`` matches them."""
    names = _parameter_names(model, optimizer)
    saved_ids = [i for group in saved["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(names):
        raise ValueError(f"the checkpoint's optimizer state has {len(saved_ids)} parameters, the optimizer "
                         f"{len(names)}")
    name_of = dict(zip(saved_ids, names))
    return {"state": {name_of[i]: value for i, value in saved["state"].items()},
            "param_groups": [{**group, "params": [name_of[i] for i in group["params"]]}
                             for group in saved["param_groups"]]}


def _optimizer_state_by_positions(model: torch.nn.Module, optimizer, saved: Mapping[str, Any]) -> dict:
    """A sharded checkpoint's optimizer state (parameters by name) in ``optimizer.state_dict()``'s form."""
    if model is None:
        raise ValueError("a sharded checkpoint's optimizer state is kept by parameter name: give the model too")
    position = {name: i for i, name in enumerate(_parameter_names(model, optimizer))}
    unknown = sorted({n for group in saved["param_groups"] for n in group["params"]} - set(position))
    if unknown:
        raise ValueError(f"the checkpoint holds optimizer state for {', '.join(unknown)}, which the optimizer's "
                         f"parameters do not include")
    return {"state": {position[name]: value for name, value in saved["state"].items()},
            "param_groups": [{**group, "params": [position[n] for n in group["params"]]}
                             for group in saved["param_groups"]]}


def _to(value: Any, location: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(location)
    if isinstance(value, dict):
        return type(value)((k, _to(v, location)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_to(v, location) for v in value)
    return value


# -- save / load --------------------------------------------------------------------------------

def _loader_list(loader: Any) -> list:
    if loader is None:
        return []
    return list(loader) if isinstance(loader, (list, tuple)) else [loader]


def _loader_epoch(loader: Any) -> int:
    if hasattr(loader, "next_epoch"):
        return int(loader.next_epoch)
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "epoch"):
        return int(sampler.epoch) + 1  # a plain DataLoader: set_epoch(e) was called for the epoch just run
    raise TypeError(f"{type(loader).__name__} has no sampler epoch to save; use ddp_notebook.distributed_loader")


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    epoch: int | None = None, *, loader: Any = None, file_mode: int = 0o600, background: bool = False,
                    **extra: Any) -> str:
    """Save a checkpoint atomically: from rank 0 for a whole model, from every rank at once for a sharded one.

    The model's weights are stored without wrapper prefixes, whatever wraps it
    (DDP, ``torch.compile``).  ``loader`` (one loader or a list) records the
    sampler epoch the next iteration will use, so a resumed run keeps the
    same data order.  ``extra`` values must be numbers, strings, tensors,
    lists or dicts (numpy numbers are converted).  Returns the path.

    Under ``if rank == 0:``: a model every rank holds whole (plain, DDP) is
    written by rank 0 alone with no collective, so it is safe there.  A
    sharded model (FSDP2 ``fully_shard``, DTensor parameters) is a directory
    that every rank writes its own shards into (``torch.distributed.checkpoint``),
    so every rank must call it: a call that some ranks do not make within
    ``DDP_NOTEBOOK_CHECKPOINT_ARRIVAL_S`` seconds (10) is refused on the ranks
    that made it, before anything is written.

    Every file is made new (``O_EXCL``, a random temporary name, renamed into
    place: never written through a link another user planted) with
    ``file_mode``: 0600 by default, readable by you alone; ``file_mode=0o640``
    lets your group read it (a sharded checkpoint's folders get the matching
    search bits: 0700, 0750).

    ``background=True`` returns as soon as the state is captured: this rank's
    part of it (weights, optimizer state, RNG state, extra values and sampler
    epoch, all as they are at the call) is copied into a staging copy in CPU
    memory, reused by the path's next save, and written from that copy in a
    thread, by the same atomic steps; the checkpoint becomes the one loads
    find only when it is whole on disk.  One save per path is in flight: the
    path's next save, ``load_checkpoint``/``resume`` of it and the task's end
    wait for it.  An error of the write is raised (``BackgroundSaveError``,
    naming the path) by this rank's next ``save_checkpoint`` or at the task's
    end; the previous checkpoint stays.  The staging copy costs about one
    copy of the rank's state in CPU memory; ``StagingMemoryError`` refuses a
    save whose copy does not fit, before anything is written.
    """
    return _save_checkpoint(path, model, optimizer, epoch, loader, file_mode, background, None, extra)


def _save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     epoch: Any, loader: Any, file_mode: int, background: bool, staging_key: Any,
                     extra: dict) -> str:
    """:func:`save_checkpoint`, with in the background the staging copy of ``staging_key`` (default: the path's)."""
    path = os.path.abspath(os.fspath(path))
    background_saves.raise_failures()
    background_saves.wait(path)
    key = (staging_key if staging_key is not None else path) if background else None
    epoch = _plain(epoch)
    rank, world_size = rank_and_world_size()
    loaders = _loader_list(loader)
    sampler_epoch: Any = [_loader_epoch(ld) for ld in loaders]
    if not isinstance(loader, (list, tuple)):
        sampler_epoch = sampler_epoch[0] if sampler_epoch else None
    if is_sharded(model):
        return _save_sharded(path, model, optimizer, {"format": FORMAT, "epoch": epoch, "sampler_epoch": sampler_epoch,
                                                      "world_size": world_size, "extra": extra}, file_mode, key)
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path} is a directory (a sharded model's checkpoint is one); a model that is not sharded is saved "
            f"as one file: save it under another path")
    count = _save_counts[path] = _save_counts.get(path, 0) + 1
    tag = f"{_job_id()}/{epoch}/{count}"
    started = time.perf_counter()
    rng = rng_state()
    checkpoint = None
    if rank == 0:
        extra = _plain(extra)
        _check_weights_only(extra, "extra value")
        optimizer_state = _plain(optimizer.state_dict()) if optimizer is not None else None
        if optimizer_state is not None:
            _check_weights_only(optimizer_state, "optimizer state entry")
        checkpoint = {
            "format": FORMAT, "model": _model_state(model), "optimizer": optimizer_state,
            "epoch": epoch, "sampler_epoch": sampler_epoch, "world_size": world_size, "rng_tag": tag,
            "extra": extra,
        }
    if key is not None and checkpoint is not None:  # (the RNG state is a copy already)
        checkpoint = background_saves.stage(key, path, checkpoint)

    def write() -> None:
        if checkpoint is not None:
            _atomic_save(checkpoint, path, file_mode, test_hook=True)
        _save_rng(rng_path(path, rank), rank, tag, rng, file_mode)

    if key is None:
        write()
    else:
        background_saves.start(path, key, write, time.perf_counter() - started, tell=rank == 0)
    return path


def wait_for_checkpoints(path: str | os.PathLike | None = None) -> None:
    """Wait until this rank's checkpoints being written in the background (to ``path``, or all of them) are on
    disk; raise the error of one that failed (``BackgroundSaveError``, naming its path).  Before a barrier after
    which another rank loads what this one saved (``load_checkpoint`` and ``resume`` wait only for their own
    rank's saves)."""
    if path is None:
        for save_path in background_saves.paths():
            background_saves.wait(save_path)
    else:
        background_saves.wait(os.path.abspath(os.fspath(path)))


@dataclass(repr=False)
class LoadedCheckpoint:
    """What :func:`load_checkpoint` found in a checkpoint, for resuming."""

    path: str
    epoch: int | None = None
    sampler_epoch: Any = None
    optimizer_state: dict | None = None
    rng_state: dict | None = None  # this rank's, when it was restored
    rng_missing_ranks: list[int] = field(default_factory=list)
    world_size: int | None = None  # of the job that saved it (None: not saved by save_checkpoint)
    extra: dict = field(default_factory=dict)
    toolkit_format: bool = True  # False: a bare state dict (or another tool's dict)
    model_state: dict | None = None  # the model's whole state dict, when no model was given to load into
    sharded: bool = False  # saved from a sharded model: a directory of every rank's shards

    @property
    def next_epoch(self) -> int:
        """The epoch a resumed loop starts from."""
        return 0 if self.epoch is None else self.epoch + 1

    @property
    def saved_world_size(self) -> int | None:
        """The earlier name of :attr:`world_size`, kept for code written against it."""
        return self.world_size

    def __repr__(self) -> str:
        # Not the fields themselves: the RNG and optimizer states run to tens of KB.
        parts = [repr(self.path), f"epoch={self.epoch}", f"next_epoch={self.next_epoch}"]
        if self.world_size is not None:
            parts.append(f"world_size={self.world_size}")
        if self.sampler_epoch is not None:
            parts.append(f"sampler_epoch={self.sampler_epoch}")
        parts.append("optimizer state" if self.optimizer_state is not None else "no optimizer state")
        if self.rng_state is not None:
            parts.append("RNG restored")
        if self.rng_missing_ranks:
            parts.append(f"no RNG state for ranks {self.rng_missing_ranks}")
        if self.extra:
            parts.append(f"extra={sorted(self.extra)}")
        if not self.toolkit_format:
            parts.append("not a save_checkpoint file")
        return f"LoadedCheckpoint({', '.join(parts)})"


class StartEpoch(int):
    """What :func:`resume` returns: the epoch a loop starts from (an ``int``), with the checkpoint it came from
    (``.checkpoint``, a :class:`LoadedCheckpoint`; None when there was none yet)."""

    checkpoint: LoadedCheckpoint | None

    def __new__(cls, epoch: int, checkpoint: LoadedCheckpoint | None = None) -> "StartEpoch":
        start = super().__new__(cls, epoch)
        start.checkpoint = checkpoint
        return start

    def __reduce__(self):  # sent anywhere (a result, a checkpoint's extra), it is the epoch: its checkpoint stays here
        return int, (int(self),)


def _rank_device() -> torch.device:
    ctx = context.current()
    if ctx is not None and ctx.device is not None:
        return torch.device(ctx.device)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _find_model_state(obj: Any) -> tuple[Mapping[str, Any], dict]:
    """The model's state dict in a loaded file: ours, a bare state dict, or a dict that holds one."""
    if isinstance(obj, Mapping) and obj.get("format") == FORMAT:
        return obj["model"], obj
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj, {}
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict", "model_state_dict", "model_state"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner, obj
    raise ValueError("no model state dict found in the checkpoint")


def _load_model_state(target: torch.nn.Module, state: Mapping[str, Any], strict: bool) -> None:
    """Load a state dict of any wrapping into ``target`` (which may hold compiled submodules itself)."""
    real_keys = {_strip(k): k for k in target.state_dict()}
    real_paths = {_strip(name): name for name, _ in target.named_modules()}
    cleaned = clean_state_dict(state, list(real_keys))
    target.load_state_dict(_translate(cleaned, lambda k: real_keys.get(k, real_paths.get(k, k))), strict=strict)


def _rng_file(path: str, rank: int, folder: str | None) -> str:
    """Rank ``rank``'s RNG state file: beside a single-file checkpoint, in a sharded checkpoint's save folder."""
    return rng_path(path, rank) if folder is None else os.path.join(folder, f"rank{rank}.rng")


def _load_rng(path: str, world_size: int, tag: str | None, rank: int,
              folder: str | None = None) -> tuple[dict | None, list[int]]:
    mine, missing = None, []
    for r in range(world_size):
        file = _rng_file(path, r, folder)
        if folder is None:
            state = _read_rng_file(file).get(tag)  # (None: missing, or only other saves' states)
        else:
            try:
                state = torch.load(file, map_location="cpu", weights_only=True)["state"]
            except FileNotFoundError:
                state = None
        if state is None:
            missing.append(r)
        elif r == rank:
            mine = state
    return mine, missing


def _in_a_job() -> bool:
    """True in a rank (a job's process group or rank context), False in the notebook or a plain script."""
    return dist.is_available() and dist.is_initialized() or context.current() is not None



def _keep_their_state(ranks: Sequence[int]) -> str:
    return "it keeps its current random state" if len(ranks) == 1 else "they keep their current random state"


def _resume_notice(path: str, saved_world_size: int | None, world_size: int, missing: Sequence[int],
                   folder: str | None = None) -> str | None:
    """What a resume of ``path`` on ``world_size`` ranks will not repeat of the run that saved it; None if all."""
    resized = saved_world_size is not None and saved_world_size != world_size
    new = [r for r in missing if resized and r >= saved_world_size]  # ranks the saving run did not have
    lost = [r for r in missing if r not in new]  # their file is missing or from another save
    notice = []
    if resized:
        notice.append(
            f"{path} was saved by {saved_world_size} rank{'s' * (saved_world_size != 1)} and is resumed on "
            f"{world_size}: the global batch size changes ({world_size} times the per-rank batch instead of "
            f"{saved_world_size} times), and with it each rank's share of every epoch's data and the order it sees "
            f"it in, so the run will not repeat the one that saved it.")
    if new:
        notice.append(f"{rendezvous.ranks_text(new).capitalize()} had no saved RNG state: {_keep_their_state(new)}.")
    if lost:
        notice.append(
            f"No RNG state for {rendezvous.ranks_text(lost)} (the file {_rng_file(path, lost[0], folder)} is "
            f"missing or from another save): {_keep_their_state(lost)}, so random draws (dropout, augmentation) will differ from the "
            f"uninterrupted run{'.' if resized else '; the data order does not depend on it.'}")
    return " ".join(notice) or None


def _warn_at_callers_line(message: str) -> None:
    """A :class:`ResumeWarning` that names the first line outside this module (the user's cell or file)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ResumeWarning, stacklevel=level)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, *, loader: Any = None,
                    restore_rng: bool | None = None, strict: bool = True,
                    map_location: Any = None) -> LoadedCheckpoint:
    """Load a checkpoint into a plain, DDP-wrapped, compiled or sharded model; the rest for resuming comes back.

    Files saved the naive way (``torch.save(ddp_model.state_dict())``, with
    ``module.`` or ``_orig_mod.`` prefixes) load too.  Storages are mapped to
    this rank's device (or ``map_location``), and the file is read with
    ``weights_only=True``.  With an ``optimizer`` its state is restored; with a
    ``loader`` (or list) its sampler epoch, so the data order continues.  In a
    rank, resuming (an optimizer or loader given) restores this rank's RNG
    state too; outside a job (in the notebook) only ``restore_rng=True`` does,
    so the notebook's own random state stays its own.  A :class:`ResumeWarning`
    at the caller's line says what will not repeat the saved run: ranks whose
    RNG state is missing (also in ``rng_missing_ranks``), or a world size other
    than the saved one (``world_size``).  Loading weights alone leaves the
    random state untouched.  If another rank has just saved the file, load
    after a barrier.  Without a model, ``.model_state`` is the whole state dict.

    Either kind of checkpoint loads into either kind of model.  Into a sharded
    model every rank must call it (each reads its own shards, resharded to
    this world size; it is refused like a ``save_checkpoint`` some ranks do
    not make); into a whole model (plain, DDP, in the notebook with no process
    group) a sharded checkpoint is read whole, with no collective.
    """
    path = os.path.abspath(os.fspath(path))
    background_saves.wait(path)
    location = map_location if map_location is not None else _rank_device()
    folder = _current_save(path)
    sharded_model = model is not None and is_sharded(model)
    if folder is None:
        obj = torch.load(path, map_location="cpu" if sharded_model else location, weights_only=True)
        state, info = _find_model_state(obj)
        optimizer_state = info.get("optimizer") or info.get("optimizer_state_dict")
    else:
        info = torch.load(os.path.join(folder, SHARDED_META), map_location="cpu", weights_only=True)
        state = optimizer_state = None
        if not sharded_model:
            whole = _load_whole(folder)
            if isinstance(location, (str, torch.device)) and torch.device(location).type != "cpu":
                whole = _to(whole, location)
            state, optimizer_state = whole["model"], whole.get("optimizer")
    ours = info.get("format") == FORMAT
    loaded = LoadedCheckpoint(
        path=path, epoch=info.get("epoch"), sampler_epoch=info.get("sampler_epoch"), optimizer_state=optimizer_state,
        world_size=info.get("world_size"), extra=dict(info.get("extra") or {}), toolkit_format=ours,
        model_state=state if model is None else None, sharded=folder is not None,
    )
    if optimizer is not None and optimizer_state is None and not (folder is not None and info.get("optimizer")):
        raise ValueError(f"{path} holds no optimizer state; save it with save_checkpoint(..., optimizer)")
    if sharded_model:
        _meet_every_rank("load_checkpoint", path)
        if folder is None:
            _load_whole_into_sharded(model, optimizer, state, optimizer_state, strict)
        else:
            loaded.optimizer_state = _load_shards(folder, model, optimizer, strict)
    else:
        if model is not None:
            _load_model_state(unwrap_model(model), state, strict)
        if optimizer is not None:
            if folder is not None:  # kept by parameter name
                optimizer_state = _optimizer_state_by_positions(model, optimizer, optimizer_state)
            optimizer.load_state_dict(optimizer_state)
    loaders = _loader_list(loader)
    if loaders:
        epochs = loaded.sampler_epoch if isinstance(loaded.sampler_epoch, list) else [loaded.sampler_epoch]
        if all(e is None for e in epochs):
            raise ValueError(f"{path} was saved without loader=, so it holds no sampler epoch to restore")
        if len(epochs) != len(loaders):
            raise ValueError(f"{path} holds sampler epochs for {len(epochs)} loader(s), {len(loaders)} given")
        for ld, ep in zip(loaders, epochs):
            (ld if hasattr(ld, "set_epoch") else ld.sampler).set_epoch(ep)  # ours, or a plain DataLoader
    if restore_rng is None:
        restore_rng = (optimizer is not None or bool(loaders)) and _in_a_job()
    if ours and (restore_rng or loaders):
        rank, world_size = rank_and_world_size()
        if restore_rng:
            loaded.rng_state, loaded.rng_missing_ranks = _load_rng(path, world_size, info.get("rng_tag"), rank,
                                                                   folder)
            if loaded.rng_state is not None:
                set_rng_state(loaded.rng_state)
        notice = _resume_notice(path, loaded.world_size, world_size, loaded.rng_missing_ranks, folder)
        if notice is not None and rank == 0:  # said once, for every rank
            _warn_at_callers_line(notice)
    return loaded


def resume(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
           loader: Any = None, *, restore_rng: bool | None = None) -> StartEpoch:
    """The epoch a loop starts from: 0 when there is no checkpoint at ``path`` yet, else the one after the
    checkpoint's, with everything :func:`load_checkpoint` restores (weights, optimizer, sampler epoch and, in a
    rank or with ``restore_rng=True``, this rank's RNG state).

    Written ``for epoch in range(resume(path, model, opt, loader), epochs)`` with ``save_checkpoint`` each epoch,
    a loop restarted by ``--max-restarts`` continues where the failed attempt last saved.  The result is an ``int``
    whose ``.checkpoint`` is the :class:`LoadedCheckpoint` (``.checkpoint.world_size``: the saved run's).
    """
    path = os.path.abspath(os.fspath(path))
    background_saves.wait(path)
    if not _has_checkpoint(path):
        return StartEpoch(0)
    if restore_rng is None:
        restore_rng = _in_a_job()
    loaded = load_checkpoint(path, model, optimizer, loader=loader, restore_rng=restore_rng)
    ctx = context.current()
    if ctx is not None and ctx.rank == 0:
        task = {"task": ctx.task_id} if ctx.task is not None else {}
        context.send(protocol.RESUMED, {**task, "epoch": loaded.next_epoch})
    return StartEpoch(loaded.next_epoch, loaded)


# -- best checkpoints ----------------------------------------------------------------------------

def _score_value(score: Any, monitor: str) -> float:
    if isinstance(score, Mapping):
        if monitor not in score:
            raise KeyError(f"the scores given have no {monitor!r} (monitor); they have {', '.join(map(str, score))}")
        score = score[monitor]
    if isinstance(score, torch.Tensor):
        return float(score.detach().item())
    return float(score)


class BestCheckpoint:
    """Keep the ``keep`` best checkpoints by a monitored score.

    ``path`` is the file for ``keep=1`` (overwritten atomically by each new
    best); for more, files are named ``<stem>-epoch<E>`` (or ``-step<N>``)
    beside it, or ``path`` can be a template with ``{epoch}``, ``{step}`` and
    ``{score}``.  Call :meth:`update` on every rank with the same score (reduce
    it first, e.g. with ``all_reduce_metrics``); for a model every rank holds
    whole it may be rank 0 only (it then needs no collective), for a sharded
    model it must be every rank, as for :func:`save_checkpoint`.  A score that
    is not strictly better than the worst kept one (or is nan) is not saved.
    Files are written with ``file_mode`` (:func:`save_checkpoint`).  An evicted
    checkpoint is removed without following links: a link found in its place
    is removed itself, and another user's file or folder there is left.
    With ``background=True`` each save is written in the background as
    :func:`save_checkpoint` writes it, from one staging copy for all of
    this object's files (an evicted file's write is waited for first).
    """

    def __init__(self, path: str | os.PathLike, monitor: str = "score", mode: str = "max", keep: int = 1,
                 file_mode: int = 0o600, background: bool = False):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', not {mode!r}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.path = os.path.abspath(os.fspath(path))
        self.monitor = monitor
        self.mode = mode
        self.keep = keep
        self.file_mode = file_mode
        self.background = background
        self.step = 0
        self.kept: list[tuple[float, str]] = []  # best first

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def _file_for(self, value: float, epoch: int | None) -> str:
        if "{" in self.path:
            return self.path.format(epoch=epoch, step=self.step, score=value)
        if self.keep == 1:
            return self.path
        stem, suffix = os.path.splitext(self.path)
        return f"{stem}-epoch{epoch}{suffix}" if epoch is not None else f"{stem}-step{self.step}{suffix}"

    @property
    def best_score(self) -> float | None:
        return self.kept[0][0] if self.kept else None

    @property
    def best_path(self) -> str | None:
        return self.kept[0][1] if self.kept else None

    def update(self, model: torch.nn.Module, score: Any, optimizer: torch.optim.Optimizer | None = None, *,
               epoch: int | None = None, loader: Any = None, **extra: Any) -> bool:
        """Save if ``score`` (a number, or a dict holding the monitored name) is among the best; True if saved."""
        self.step += 1
        value = _score_value(score, self.monitor)
        if value != value:  # nan
            return False
        if len(self.kept) >= self.keep and not self._better(value, self.kept[-1][0]):
            return False
        file = self._file_for(value, epoch)
        extra = {**extra, self.monitor: value, "mode": self.mode}
        _save_checkpoint(file, model, optimizer, epoch, loader, self.file_mode, self.background, self, extra)
        self.kept = [(s, p) for s, p in self.kept if p != file]
        self.kept.append((value, file))
        self.kept.sort(key=lambda item: item[0], reverse=self.mode == "max")
        evicted = [p for _, p in self.kept[self.keep:]]
        self.kept = self.kept[:self.keep]
        for old in evicted:
            background_saves.wait(old)
            _remove_checkpoint(old)
        return True


def _remove_checkpoint(path: str) -> None:
    """Rank 0 removes the checkpoint and every rank's RNG file; other ranks remove their own RNG file.  Of a
    sharded checkpoint's directory only what a save put there goes (then the directory, if that left it empty).
    Nothing is removed through a link: a link at ``path`` (or at a save's name) is removed itself, through the
    descriptor of the folder it is in, and another user's file or folder is left."""
    rank, _ = rank_and_world_size()
    _rng_saves.pop(rng_path(os.path.abspath(path), rank), None)  # (its RNG states go with it)
    directory, base = os.path.split(path)
    try:
        parent = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _remove_checkpoint_in(parent, base, rank)
    finally:
        os.close(parent)


def _remove_checkpoint_in(parent: int, base: str, rank: int) -> None:
    try:
        st = os.lstat(base, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        if rank != 0 or not safe_files.is_ours(st):
            return
        try:
            fd = safe_files.open_folder(base, dir_fd=parent)  # (a link put there since the lstat: ELOOP)
        except OSError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHARDED_INDEX, dir_fd=fd)  # first: no half-removed checkpoint looks complete
            _remove_saves(fd, keep=None)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(base, dir_fd=parent)  # (not if something of the user's is in it)
        return
    doomed = [f"{base}.rank{rank}.rng"]  # (rng_path's name)
    if rank == 0:
        doomed.append(base)
        with contextlib.suppress(OSError):
            doomed += [n for n in os.listdir(parent) if n.startswith(base + ".rank") and n.endswith(".rng")]
    for name in doomed:
        with contextlib.suppress(OSError):
            safe_files.remove(name, parent)
