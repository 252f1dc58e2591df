"""Run PyTorch DDP from a Jupyter notebook: ``%load_ext ddp_notebook`` then ``%%ddp``.

Importing this package is cheap on purpose: every rank imports it, so the
notebook-only parts (IPython magics, widgets, plots) load only when used.
"""
from __future__ import annotations

from .context import current as rank_context
from .errors import LaunchError, RankError
from .metrics import Sum, progress, report

__version__ = "0.1.0"

__all__ = [
    "launch", "spawn", "last_job", "Job", "RankError", "LaunchError", "rank_context", "load_ipython_extension",
    "report", "progress", "Sum",
    "gpu_picker", "export", "follow",
    "distributed_loader", "all_reduce_metrics", "save_checkpoint", "load_checkpoint", "BestCheckpoint",
    "clean_state_dict", "unwrap_model",
]

# Rank-side helpers that import torch: loaded on first use, never by importing the package.
_DATA_NAMES = ("distributed_loader", "all_reduce_metrics", "DistributedLoader", "ExactDistributedSampler")
_CHECKPOINT_NAMES = ("save_checkpoint", "load_checkpoint", "BestCheckpoint", "LoadedCheckpoint", "ResumeWarning",
                     "clean_state_dict", "unwrap_model")


def __getattr__(name):
    # Lazy: the launcher pulls in subprocess and socket handling the ranks never need.
    if name in ("launch", "spawn", "last_job", "Job", "JobSpec"):
        from . import dashboard, launcher

        dashboard.install()  # launch() from Python: live metrics as text lines, or widgets in a kernel
        return getattr(launcher, name)
    if name == "export":  # notebook side: a cell or function as a script for torchrun
        from .exporting import export

        return export
    if name == "follow":  # notebook side: the dashboard of a torchrun job, from its metrics files
        from .following import follow

        return follow
    if name == "gpu_picker":  # notebook side only: imports ipywidgets
        from .picker import gpu_picker

        return gpu_picker
    if name in _DATA_NAMES:
        from . import data

        return getattr(data, name)
    if name in _CHECKPOINT_NAMES:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module 'ddp_notebook' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """``%load_ext ddp_notebook``: register the ``%%ddp`` magics."""
    from .magic import register

    register(ipython)
