"""Which cells IPython compiled: what the wire's cell sources (``wire/payload.py``) read, from the notebook side.

IPython keeps the map of the files it compiled cells into (file -> execution count) in its compiler's
``_filename_map``; no public API gives it.  The front doors :func:`install` :func:`cell_files` into the wire
(``payload.read_cells_with``), so the wire never looks into IPython itself.
"""
from __future__ import annotations

import sys

from ..wire import payload


def cell_files() -> tuple[dict[str, int], int]:
    """IPython's map of the cell files it compiled (file -> execution count) and its execution count now; ({}, 0)
    outside IPython."""
    ipython = sys.modules.get("IPython")  # the notebook's shell, if this process has one (never imported here)
    shell = ipython.get_ipython() if ipython is not None else None
    filename_map = getattr(getattr(shell, "compile", None), "_filename_map", None) or {}
    return filename_map, getattr(shell, "execution_count", 0) or 0


def install() -> None:
    """The wire's cell sources (tracebacks at the cells' own lines) read the cells IPython compiled from now on."""
    payload.read_cells_with(cell_files)
