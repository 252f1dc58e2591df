"""Saving: a whole model from rank 0 as one atomic file, a sharded one by every rank; in the background on request."""
from __future__ import annotations

import os
import time
from typing import Any

import torch

from .. import background_saves
from ..data import rank_and_world_size
from .files import atomic_save
from .format import FORMAT
from .keys import plain_model_state
from .rng import job_id, rng_path, rng_state, save_rng
from .sharded import is_sharded, save_sharded
from .values import check_weights_only, plain_values


_save_counts: dict[str, int] = {}


def loader_list(loader: Any) -> list:
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
    return save(path, model, optimizer, epoch, loader, file_mode, background, None, extra)


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     epoch: Any, loader: Any, file_mode: int, background: bool, staging_key: Any,
                     extra: dict) -> str:
    """:func:`save_checkpoint`, with in the background the staging copy of ``staging_key`` (default: the path's)."""
    path = os.path.abspath(os.fspath(path))
    background_saves.raise_failures()
    background_saves.wait(path)
    key = (staging_key if staging_key is not None else path) if background else None
    epoch = plain_values(epoch)
    rank, world_size = rank_and_world_size()
    loaders = loader_list(loader)
    sampler_epoch: Any = [_loader_epoch(ld) for ld in loaders]
    if not isinstance(loader, (list, tuple)):
        sampler_epoch = sampler_epoch[0] if sampler_epoch else None
    if is_sharded(model):
        return save_sharded(path, model, optimizer, {"format": FORMAT, "epoch": epoch, "sampler_epoch": sampler_epoch,
                                                      "world_size": world_size, "extra": extra}, file_mode, key)
    if os.path.isdir(path):
        raise IsADirectoryError(
            f"{path} is a directory (a sharded model's checkpoint is one); a model that is not sharded is saved "
            f"as one file: save it under another path")
    count = _save_counts[path] = _save_counts.get(path, 0) + 1
    tag = f"{job_id()}/{epoch}/{count}"
    started = time.perf_counter()
    rng = rng_state()
    checkpoint = None
    if rank == 0:
        extra = plain_values(extra)
        check_weights_only(extra, "extra value")
        optimizer_state = plain_values(optimizer.state_dict()) if optimizer is not None else None
        if optimizer_state is not None:
            check_weights_only(optimizer_state, "optimizer state entry")
        checkpoint = {
            "format": FORMAT, "model": plain_model_state(model), "optimizer": optimizer_state,
            "epoch": epoch, "sampler_epoch": sampler_epoch, "world_size": world_size, "rng_tag": tag,
            "extra": extra,
        }
    if key is not None and checkpoint is not None:  # (the RNG state is a copy already)
        checkpoint = background_saves.stage(key, path, checkpoint)

    def write() -> None:
        if checkpoint is not None:
            atomic_save(checkpoint, path, file_mode)
        save_rng(rng_path(path, rank), rank, tag, rng, file_mode)

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
