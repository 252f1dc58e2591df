"""The files a checkpoint is made of: format names, file names, and the environment variables that tune saves."""
from __future__ import annotations

FORMAT = "ddp_notebook.checkpoint/1"
RNG_FORMAT = "ddp_notebook.rng/1"  # a rank's RNG state in a sharded checkpoint's save folder
RNG_SAVES_FORMAT = "ddp_notebook.rng_saves/1"  # a rank's RNG file beside a one-file checkpoint (RNG_FORMAT: read)
RNG_SAVES_KEPT = 3  # a rank's RNG file keeps its last saves' states: the model file may still name an older one
SHARDED_FORMAT = "ddp_notebook.sharded_checkpoint/1"
SHARDED_INDEX = "checkpoint.json"  # in a sharded checkpoint's directory: names its one complete save
SHARDED_META = "meta.pt"  # in each save's folder: epoch, sampler epoch, world size, extra values
SAVE_FOLDER_PREFIX = "save-"  # each sharded save's own folder; the only folders a save ever removes
ARRIVAL_TIMEOUT_ENV = "DDP_NOTEBOOK_CHECKPOINT_ARRIVAL_S"
ARRIVAL_TIMEOUT_S = 10.0
