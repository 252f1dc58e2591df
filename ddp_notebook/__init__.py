"""Run PyTorch DDP from a Jupyter notebook: ``%load_ext ddp_notebook`` then ``%%ddp``.

Importing this package is cheap on purpose: every rank imports it, so the
notebook-only parts (IPython magics, widgets, plots) load only when used.
"""
from __future__ import annotations

import logging as _logging
import os as _os

from .rank.context import attempt, current as rank_context
from .wire.errors import DDPNotebookError, JobStopped, LaunchError, RankError, Stopped
from .rank.metrics import Sum, progress, report
from .rank.stopping import should_stop
from .version import __version__

if _os.environ.get("DDP_NOTEBOOK_DEBUG", "").strip() not in ("", "0"):
    # The engine's lifecycle (ports, ranks started, messages, exits, clean-up) on stderr: where a hung job is.
    _logging.basicConfig(format="%(asctime)s ddp_notebook %(message)s")
    _logging.getLogger("ddp_notebook").setLevel(_logging.DEBUG)


__all__ = [
    "launch", "spawn", "last_job", "Job", "RankError", "LaunchError", "JobStopped", "Stopped", "DDPNotebookError",
    "rank_context", "attempt", "resume", "load_ipython_extension",
    "report", "progress", "Sum", "should_stop",
    "gpu_picker", "export", "follow",
    "distributed_loader", "all_reduce_metrics", "save_checkpoint", "load_checkpoint", "BestCheckpoint",
    "clean_state_dict", "unwrap_model",
]

# Rank-side helpers that import torch: loaded on first use, never by importing the package.
_DATA_NAMES = ("distributed_loader", "all_reduce_metrics", "DistributedLoader", "ExactDistributedSampler", "ShardSampler")
_CHECKPOINT_NAMES = ("save_checkpoint", "load_checkpoint", "resume", "BestCheckpoint", "LoadedCheckpoint", "ResumeWarning",
                     "clean_state_dict", "unwrap_model", "BackgroundSaveError", "StagingMemoryError",
                     "wait_for_checkpoints")


def __getattr__(name):
    # Lazy: the launcher pulls in subprocess and socket handling the ranks never need.
    if name in ("launch", "spawn", "last_job", "Job", "JobSpec"):
        from . import api
        from .notebook import dashboard

        dashboard.install()  # launch() from Python: live metrics as text lines, or widgets in a kernel
        return getattr(api, name)
    if name == "export":  # notebook side: a cell or function as a script for torchrun
        from .engine.export import export
        from .notebook import ipython_cells

        ipython_cells.install()  # (the script carries the notebook's cells for its tracebacks)

        return export
    if name == "follow":  # notebook side: the dashboard of a torchrun job, from its metrics files
        from .notebook.following import follow

        return follow
    if name == "gpu_picker":  # notebook side only: imports ipywidgets
        from .notebook.picker import gpu_picker

        return gpu_picker
    if name in _DATA_NAMES:
        from .rank import data

        return getattr(data, name)
    if name in _CHECKPOINT_NAMES:
        from .rank import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'ddp_notebook' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext ddp_notebook``: register the ``%%ddp`` magics and start the rank template in the background."""
    import importlib
    import threading

    from .engine import template
    from .notebook.magic import register

    register(ipython)
    template.warm_up()  # ranks fork from it: the first cell need not wait for torch to import
    # On a thread, not in the first cells: the Stop button a background cell shows at once (0.26 s), and which
    # libraries are installed (0.2 s), for the template to preload the notebook's.
    threading.Thread(target=lambda: (importlib.import_module("ipywidgets"), template.read_installed()),
                     name="ddp_notebook-prefetch", daemon=True).start()
    ipython.events.register("post_run_cell", template.preload_notebook_libraries)  # what the cell imported
