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

A package of one concern a module, for the next one to find its place (``ARCHITECTURE.md``):
``format`` (file and format names), ``keys`` (wrapper prefixes), ``values`` (what weights-only loading accepts),
``files`` (atomic writes), ``rng`` (each rank's RNG state), ``sharded`` (the folder every rank writes, its commit
and its reads), ``saving``, ``loading`` (and resuming), ``best`` (``BestCheckpoint``), ``reader`` (a sharded
folder read weights-only).  Background saves stage and write through ``rank/background_saves.py``, which a rank
imports at start without torch.
"""
from __future__ import annotations

from ..background_saves import BackgroundSaveError, StagingMemoryError
from ...wire.payload import unwrap_model
from .best import BestCheckpoint
from .format import (ARRIVAL_TIMEOUT_ENV, ARRIVAL_TIMEOUT_S, FORMAT, RNG_FORMAT, RNG_SAVES_FORMAT, RNG_SAVES_KEPT,
                     SAVE_FOLDER_PREFIX, SHARDED_FORMAT, SHARDED_INDEX, SHARDED_META)
from .keys import clean_state_dict
from .loading import LoadedCheckpoint, ResumeWarning, StartEpoch, load_checkpoint, rank_device, resume
from .rng import rng_path, rng_state, set_rng_state
from .saving import save_checkpoint, wait_for_checkpoints
from .sharded import is_sharded

__all__ = [
    "save_checkpoint", "load_checkpoint", "resume", "wait_for_checkpoints", "BestCheckpoint", "LoadedCheckpoint",
    "StartEpoch", "ResumeWarning", "BackgroundSaveError", "StagingMemoryError", "clean_state_dict", "unwrap_model",
    "is_sharded", "rank_device", "rng_path", "rng_state", "set_rng_state",
    "FORMAT", "RNG_FORMAT", "RNG_SAVES_FORMAT", "RNG_SAVES_KEPT", "SHARDED_FORMAT",
    "SHARDED_INDEX", "SHARDED_META", "SAVE_FOLDER_PREFIX", "ARRIVAL_TIMEOUT_ENV", "ARRIVAL_TIMEOUT_S",
]
