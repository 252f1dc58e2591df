"""Rich output from a rank: ``display(obj)`` and ``plt.show()`` show in the notebook cell.

Nothing here runs at a rank's start, and nothing imports IPython or matplotlib
until a cell does:

- matplotlib: ranks start with ``MPLBACKEND=module://ddp_notebook.rank.mpl_backend``,
  pyplot's backend (Agg drawing) once a cell imports pyplot; its ``show`` sends
  every open figure as ``image/png`` (:func:`send_figures`) and closes it.
- IPython: :func:`install` puts a watcher on ``sys.meta_path`` that, the moment a
  cell imports ``IPython.display``, replaces its ``display`` (which, with no shell,
  would only print ``<IPython.core.display.HTML object>``) by :func:`display`;
  and the moment one imports ``tqdm.notebook`` (or unpickles a bar class of it
  the notebook uses), makes its bars tqdm's text bars.

The object's rich representations travel as one ``protocol.DISPLAY`` message;
the notebook labels it with the rank and respects ``--output``.  Outside a
rank everything falls back to matplotlib's and IPython's own behaviour.
"""
from __future__ import annotations

import base64
import builtins
import importlib.abc
import importlib.machinery
import io
import sys

from ..wire import protocol
from . import context

RICH_TYPES = ("text/html", "text/markdown", "text/latex", "image/png", "image/jpeg", "image/svg+xml",
              "application/json", "text/plain")


def _sender():
    ctx = context.current()
    return None if ctx is None else ctx.sender


def send(data: dict, metadata: dict | None = None) -> None:
    """Send one display bundle to the notebook (and wait until it is on its way)."""
    sender = _sender()
    sender.send(protocol.DISPLAY, {"data": data, "metadata": metadata or {}})
    sender.flush()


def _figure_png(figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def bundle(obj, include=None, exclude=None) -> tuple[dict, dict]:
    """The object's representations as a display bundle: a matplotlib figure is drawn to PNG."""
    if type(obj).__module__.startswith("matplotlib") and hasattr(obj, "savefig"):
        return {"image/png": _figure_png(obj), "text/plain": repr(obj)}, {}
    from IPython.core.formatters import DisplayFormatter

    data, metadata = DisplayFormatter().format(obj, include=include, exclude=exclude)
    data = {kind: value for kind, value in data.items() if kind in RICH_TYPES}
    if isinstance(data.get("image/png"), bytes):
        data["image/png"] = base64.b64encode(data["image/png"]).decode()
    return data, metadata


def display(*objs, include=None, exclude=None, metadata=None, raw=False, **_ignored) -> None:
    """IPython's ``display``, for a rank: each object shows in the notebook cell, labelled with the rank."""
    if _sender() is None:
        from IPython.core.display_functions import display as ipython_display

        return ipython_display(*objs, include=include, exclude=exclude, metadata=metadata, raw=raw)
    for obj in objs:
        data, meta = (dict(obj), {}) if raw else bundle(obj, include, exclude)
        send(data, {**meta, **(metadata or {})})
    return None


def _route_display(module) -> None:
    module.display = display


def _text_bars(module) -> None:
    # A rank has no widgets (tqdm.notebook's bar would show once, as text, and never move): its bars are tqdm's
    # text bars, which the notebook relays live.  tqdm.auto picks them in a rank by itself.
    from tqdm import std

    module.tqdm = module.tqdm_notebook = std.tqdm
    module.trange = module.tnrange = std.trange


class _Patch(importlib.abc.MetaPathFinder):
    """Once a module of ``PATCHES`` is imported, patch it."""

    PATCHES = {"IPython.core.display_functions": _route_display, "tqdm.notebook": _text_bars}

    def find_spec(self, name, path, target=None):
        patch = self.PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Route a cell's ``display()`` to the notebook, and make ``tqdm.notebook``'s bars text bars (costs nothing
    until a cell imports IPython.display or tqdm.notebook).

    ``display`` is also a builtin, as in the notebook's kernel, so a cell may call it without an import.
    """
    builtins.__dict__.setdefault("display", display)
    if any(isinstance(finder, _Patch) for finder in sys.meta_path):
        return
    for name, patch in _Patch.PATCHES.items():
        loaded = sys.modules.get(name)
        if loaded is not None:
            patch(loaded)
    sys.meta_path.insert(0, _Patch())


def send_figures() -> None:
    """``plt.show()`` in a rank: every open figure goes to the notebook as ``image/png``, then closes."""
    from matplotlib import pyplot

    if _sender() is None:
        return
    try:
        for number in pyplot.get_fignums():
            figure = pyplot.figure(number)
            send({"image/png": _figure_png(figure), "text/plain": repr(figure)})
    finally:
        pyplot.close("all")
