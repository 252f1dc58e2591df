"""Forward reduced metric records from the notebook process to loggers.

A callback is any callable taking one dict: the x key (``epoch`` or ``step``)
and the values just reduced over all ranks.  One with a ``close()`` method is
closed when the job ends.  Ranks never talk to these services, so they need no
logins or network access.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
import traceback
import types
import warnings
from typing import Any, Callable, Iterable

from ..wire.errors import LaunchError
from ..wire.protocol import META_KEYS


def _metric_items(record: dict):
    return [(name, value) for name, value in record.items() if name not in META_KEYS]


def _require(package: str, what: str) -> None:
    """Refuse now, before any rank starts, a logger whose package is missing (it would drop every record)."""
    if sys.modules.get(package) is not None:  # imported already (None there: blocked)
        return
    try:
        found = importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LaunchError(f"{what} needs the {package} package, which this Python ({sys.executable}) cannot "
                          f"import: pip install {package}")


def _x_of(record: dict) -> int:
    x = record["step"] if "step" in record else record.get("epoch", 0)
    return int(x)


class TensorBoard:
    """Write each record as scalars with ``torch.utils.tensorboard.SummaryWriter(logdir)``."""

    def __init__(self, logdir: str):
        _require("tensorboard", f"TensorBoard logging (--tensorboard {logdir})")
        self.logdir = logdir
        self._writer = None

    def __call__(self, record: dict) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(self.logdir)
        step = _x_of(record)
        for name, value in _metric_items(record):
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandB:
    """Log each record to the current Weights & Biases run (``wandb.init()`` is called if there is none)."""

    def __init__(self, **init_kwargs: Any):
        _require("wandb", "Weights & Biases logging (--callback wandb)")
        self.init_kwargs = init_kwargs

    def __call__(self, record: dict) -> None:
        import wandb

        if wandb.run is None:
            wandb.init(**self.init_kwargs)
        wandb.log({k: v for k, v in record.items() if k != "partial"})

    def close(self) -> None:
        pass  # the run is the user's: they finish it


def resolve(callback: Any) -> Callable[[dict], None]:
    """A callable for ``callback``: a callable as is, ``"wandb"`` or the wandb module for :class:`WandB`."""
    if (isinstance(callback, str) and callback == "wandb") or \
            (isinstance(callback, types.ModuleType) and callback.__name__ == "wandb"):
        return WandB()
    if not callable(callback):
        raise TypeError(f"a callback must be callable (one dict argument) or 'wandb', not {callback!r}")
    return callback


def as_list(callbacks: Any) -> list:
    """``callbacks`` as a list: one callback given alone (``callbacks=print``, ``callbacks="wandb"``) is a list of it
    (as is anything else that is no list of them: :func:`resolve` then says what a callback must be)."""
    if callable(callbacks) or isinstance(callbacks, (str, types.ModuleType)) or not isinstance(callbacks, Iterable):
        return [callbacks]
    return list(callbacks)


def resolve_all(callbacks: Any) -> list[Callable[[dict], None]]:
    """:func:`resolve` for each of ``callbacks`` (:func:`as_list`)."""
    return [resolve(callback) for callback in as_list(callbacks)]


class Forwarder:
    """Sends updates to every callback; one that raises is reported once and dropped, training goes on."""

    def __init__(self, callbacks: Iterable[Any] = ()):
        self.callbacks = resolve_all(callbacks)

    def send(self, updates: list[dict]) -> None:
        for callback in list(self.callbacks):
            for update in updates:
                try:
                    callback(dict(update))
                except Exception as exc:  # noqa: BLE001 - a logger must not stop the job
                    self.callbacks.remove(callback)
                    _warn_failed(callback, exc)
                    break

    def close(self) -> None:
        for callback in self.callbacks:
            close = getattr(callback, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:  # noqa: BLE001
                    print(f"ddp_notebook: closing metrics callback {_name(callback)} failed: {exc!r}",
                          file=sys.stderr)
        self.callbacks = []


def _warn_failed(callback: Any, exc: BaseException) -> None:
    """Warn once, naming the callback and its error, at the line that raised (not ddp_notebook's)."""
    frames = traceback.extract_tb(exc.__traceback__)[1:]  # the first is send()'s call
    where = frames[-1] if frames else None
    message = (f"ddp_notebook: metrics callback {_name(callback)} raised {type(exc).__name__}: {exc}; "
               f"it gets no more records of this job")
    if where is None:  # raised in C (a builtin): no line of Python to point at
        warnings.warn(message, UserWarning, stacklevel=4)
    else:
        warnings.warn_explicit(message, UserWarning, where.filename, where.lineno or 0)


def _name(callback: Any) -> str:
    """The callback's qualified name: ``train.log_metrics``, ``MyLogger.__call__``, ``list.append``."""
    target = callback.func if isinstance(callback, functools.partial) else callback
    qualname = getattr(target, "__qualname__", None)
    if qualname is None:  # a callable instance
        target = type(target)
        qualname = target.__qualname__
    module = getattr(target, "__module__", None)
    if module is None:
        owner = getattr(target, "__self__", None)  # a builtin's bound method (records.append)
        module = type(owner).__module__ if owner is not None else None
    name = qualname if module in (None, "__main__", "builtins") else f"{module}.{qualname}"
    return f"functools.partial({name})" if target is not callback and isinstance(callback, functools.partial) \
        else name
