"""Loading and resuming: either kind of checkpoint into either kind of model, and what a faithful resume needs."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from .. import background_saves, context, rendezvous
from ..data import rank_and_world_size
from ...wire import protocol
from ...wire.payload import unwrap_model
from .format import FORMAT, SHARDED_META
from .keys import clean_state_dict, strip_key, translate_keys
from .rng import load_rng, rng_file, set_rng_state
from .saving import loader_list
from .sharded import (current_save, has_checkpoint, is_sharded, load_shards, load_whole, load_whole_into_sharded,
                      meet_every_rank, optimizer_state_by_positions, to_location)


class ResumeWarning(UserWarning):
    """A checkpoint was loaded, but something a faithful resume needs was missing."""


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


def rank_device() -> torch.device:
    """Where this rank's loads map storages to: its own device (the job's), the current CUDA device, or the CPU."""
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
    real_keys = {strip_key(k): k for k in target.state_dict()}
    real_paths = {strip_key(name): name for name, _ in target.named_modules()}
    cleaned = clean_state_dict(state, list(real_keys))
    target.load_state_dict(translate_keys(cleaned, lambda k: real_keys.get(k, real_paths.get(k, k))), strict=strict)


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
            f"No RNG state for {rendezvous.ranks_text(lost)} (the file {rng_file(path, lost[0], folder)} is "
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
    location = map_location if map_location is not None else rank_device()
    folder = current_save(path)
    sharded_model = model is not None and is_sharded(model)
    if folder is None:
        obj = torch.load(path, map_location="cpu" if sharded_model else location, weights_only=True)
        state, info = _find_model_state(obj)
        optimizer_state = info.get("optimizer") or info.get("optimizer_state_dict")
    else:
        info = torch.load(os.path.join(folder, SHARDED_META), map_location="cpu", weights_only=True)
        state = optimizer_state = None
        if not sharded_model:
            whole = load_whole(folder)
            if isinstance(location, (str, torch.device)) and torch.device(location).type != "cpu":
                whole = to_location(whole, location)
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
        meet_every_rank("load_checkpoint", path)
        if folder is None:
            load_whole_into_sharded(model, optimizer, state, optimizer_state, strict)
        else:
            loaded.optimizer_state = load_shards(folder, model, optimizer, strict)
    else:
        if model is not None:
            _load_model_state(unwrap_model(model), state, strict)
        if optimizer is not None:
            if folder is not None:  # kept by parameter name
                optimizer_state = optimizer_state_by_positions(model, optimizer, optimizer_state)
            optimizer.load_state_dict(optimizer_state)
    loaders = loader_list(loader)
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
            loaded.rng_state, loaded.rng_missing_ranks = load_rng(path, world_size, info.get("rng_tag"), rank,
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
    if not has_checkpoint(path):
        return StartEpoch(0)
    if restore_rng is None:
        restore_rng = _in_a_job()
    loaded = load_checkpoint(path, model, optimizer, loader=loader, restore_rng=restore_rng)
    ctx = context.current()
    if ctx is not None and ctx.rank == 0:
        task = {"task": ctx.task_id} if ctx.task is not None else {}
        context.send(protocol.RESUMED, {**task, "epoch": loaded.next_epoch})
    return StartEpoch(loaded.next_epoch, loaded)
