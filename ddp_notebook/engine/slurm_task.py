"""What each task of a ``%%ddp --executor`` Slurm job runs, as submitit ships it.

A small picklable command, unpickled by submitit on the compute node, that
starts the rank as a process of its own (``python -m ddp_notebook.rank.slurm``)
with the task's environment and log files: the rank keeps its own signal
handling, and submitit's process never imports torch.  Imports nothing heavy.
"""
from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass


@dataclass
class RankCommand:
    """Run the rank of this Slurm task on the export whose manifest is ``manifest``."""

    manifest: str

    def __call__(self) -> int:
        code = subprocess.call([sys.executable, "-u", "-m", "ddp_notebook.rank.slurm", self.manifest])
        if code:
            raise SystemExit(code)  # Slurm records the task as failed; its story went to the notebook or the files
        return code
