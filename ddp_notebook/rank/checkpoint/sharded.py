"""Sharded models (FSDP2, DTensor): a checkpoint is a folder that every rank writes its shards into at once
(``torch.distributed.checkpoint``), made current by one index file once every rank has written; read back
resharded to any world size, or whole in one process.  The call is a meeting of every rank in the job's
store first, so a call that some ranks do not make is refused, where a collective would hang."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import stat
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import background_saves, rendezvous
from ..background_saves import StagingMemoryError
from ..data import rank_and_world_size
from ...wire import safe_files
from ...wire.payload import unwrap_model
from .files import atomic_save
from .format import (ARRIVAL_TIMEOUT_ENV, ARRIVAL_TIMEOUT_S, RNG_FORMAT, SAVE_FOLDER_PREFIX, SHARDED_FORMAT,
                     SHARDED_INDEX, SHARDED_META)
from .keys import clean_state_dict, strip_key
from .rng import rng_state
from .values import check_weights_only, plain_values


_meetings: dict[tuple[str, str], int] = {}
_background_group: tuple[Any, Any] | None = None  # (the default process group, the gloo group background saves use)
_last_sharded_background: str | None = None  # the path of this rank's latest background save of a sharded model


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


def meet_every_rank(call: str, path: str) -> _Meeting:
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


def save_sharded(path: str, model: torch.nn.Module, optimizer, record: dict, file_mode: int,
                  background: Any = None) -> str:
    """Every rank writes its shards into a new save folder inside the directory ``path``; once all have, rank 0
    makes it the current one (the index file, replaced atomically) and removes the earlier saves.  With a
    ``background`` staging key, the state is staged (a CPU copy) and all of that happens in a thread."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    global _last_sharded_background
    rank, world_size = rank_and_world_size()
    record["extra"] = plain_values(record["extra"])
    check_weights_only(record["extra"], "extra value")
    _checkpoint_folder(path, None)  # (before the meeting, writing nothing: refused on every rank alike)
    if _last_sharded_background is not None:
        # One sharded save in flight at a time, whatever its path: its collectives (in the one group background
        # saves use) then come in the same order on every rank.
        background_saves.wait(_last_sharded_background)
        _last_sharded_background = None
    meeting = meet_every_rank("save_checkpoint", path)
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
            remove_saves(path, keep=None, only=meeting.folder_name)
        raise

    def write(group: Any = None) -> None:
        try:
            atomic_save({"format": RNG_FORMAT, "rank": rank, "state": everything["rng"]},
                         os.path.join(folder, f"rank{rank}.rng"), file_mode)
            if rank == 0:
                atomic_save(everything["record"], os.path.join(folder, SHARDED_META), file_mode)
            # Returns once every rank has written (fsynced) its shards and rank 0 the metadata.
            dcp.save(everything["state"], storage_writer=dcp.FileSystemWriter(folder), process_group=group)
        except BaseException:
            if rank == 0:
                remove_saves(path, keep=None, only=meeting.folder_name)
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
        index = os.path.join(path, SHARDED_INDEX)
        with safe_files.replace_atomically(index, file_mode) as f:
            f.write(json.dumps({"format": SHARDED_FORMAT, "current": meeting.folder_name}).encode())
        remove_saves(path, keep=meeting.folder_name)
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


def remove_saves(path: str | int, keep: str | None, only: str | None = None) -> None:
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


def current_save(path: str) -> str | None:
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


def has_checkpoint(path: str) -> bool:
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, SHARDED_INDEX))


def load_whole(folder: str) -> dict:
    """Every tensor and value of a sharded save, whole, in this process: no process group needed, no collective."""
    from torch.distributed import checkpoint as dcp

    from .reader import WeightsOnlyReader

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

    from .reader import UnsafeCheckpointError

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


def load_shards(folder: str, model: torch.nn.Module, optimizer, strict: bool) -> dict | None:
    """Every rank reads its own shards of a sharded save (resharded to this world size); the optimizer's state."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    from .reader import WeightsOnlyReader

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


def load_whole_into_sharded(model: torch.nn.Module, optimizer, state: Mapping[str, Any],
                             optimizer_state: dict | None, strict: bool) -> None:
    """A whole state dict (a single-file checkpoint) into a sharded model: every rank keeps its own shards."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    expected = [strip_key(k) for k in unwrap_model(model).state_dict()]
    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, clean_state_dict(state, expected), options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, _optimizer_state_by_names(model, optimizer, optimizer_state),
                                 options=options)


def _parameter_names(model: torch.nn.Module, optimizer) -> list[str]:
    """The names in ``model`` of ``optimizer``'s parameters, in the optimizer's order."""
    names = {id(p): strip_key(n) for n, p in unwrap_model(model).named_parameters()}
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


def optimizer_state_by_positions(model: torch.nn.Module, optimizer, saved: Mapping[str, Any]) -> dict:
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


def to_location(value: Any, location: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(location)
    if isinstance(value, dict):
        return type(value)((k, to_location(v, location)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(to_location(v, location) for v in value)
    return value
