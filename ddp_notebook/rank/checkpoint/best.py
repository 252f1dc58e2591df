"""The best ``keep`` checkpoints by a monitored score; the evicted ones removed without following links."""
from __future__ import annotations

import contextlib
import os
import stat
from typing import Any, Mapping

import torch

from .. import background_saves
from ..data import rank_and_world_size
from ...wire import safe_files
from .format import SHARDED_INDEX
from .rng import forget_saves, rng_path
from .saving import save
from .sharded import remove_saves


def _score_value(score: Any, monitor: str) -> float:
    if isinstance(score, Mapping):
        if monitor not in score:
            raise KeyError(f"the scores given have no {monitor!r} (monitor); they have {', '.join(map(str, score))}")
        score = score[monitor]
    if isinstance(score, torch.Tensor):
        return float(score.detach().item())
    return float(score)


class BestCheckpoint:
    """Keep the ``keep`` best checkpoints by a monitored score.

    ``path`` is the file for ``keep=1`` (overwritten atomically by each new
    best); for more, files are named ``<stem>-epoch<E>`` (or ``-step<N>``)
    beside it, or ``path`` can be a template with ``{epoch}``, ``{step}`` and
    ``{score}``.  Call :meth:`update` on every rank with the same score (reduce
    it first, e.g. with ``all_reduce_metrics``); for a model every rank holds
    whole it may be rank 0 only (it then needs no collective), for a sharded
    model it must be every rank, as for :func:`save_checkpoint`.  A score that
    is not strictly better than the worst kept one (or is nan) is not saved.
    Files are written with ``file_mode`` (:func:`save_checkpoint`).  An evicted
    checkpoint is removed without following links: a link found in its place
    is removed itself, and another user's file or folder there is left.
    With ``background=True`` each save is written in the background as
    :func:`save_checkpoint` writes it, from one staging copy for all of
    this object's files (an evicted file's write is waited for first).
    """

    def __init__(self, path: str | os.PathLike, monitor: str = "score", mode: str = "max", keep: int = 1,
                 file_mode: int = 0o600, background: bool = False):
        if mode not in ("max", "min"):
            raise ValueError(f"mode must be 'max' or 'min', not {mode!r}")
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.path = os.path.abspath(os.fspath(path))
        self.monitor = monitor
        self.mode = mode
        self.keep = keep
        self.file_mode = file_mode
        self.background = background
        self.step = 0
        self.kept: list[tuple[float, str]] = []  # best first

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.mode == "max" else a < b

    def _file_for(self, value: float, epoch: int | None) -> str:
        if "{" in self.path:
            return self.path.format(epoch=epoch, step=self.step, score=value)
        if self.keep == 1:
            return self.path
        stem, suffix = os.path.splitext(self.path)
        return f"{stem}-epoch{epoch}{suffix}" if epoch is not None else f"{stem}-step{self.step}{suffix}"

    @property
    def best_score(self) -> float | None:
        return self.kept[0][0] if self.kept else None

    @property
    def best_path(self) -> str | None:
        return self.kept[0][1] if self.kept else None

    def update(self, model: torch.nn.Module, score: Any, optimizer: torch.optim.Optimizer | None = None, *,
               epoch: int | None = None, loader: Any = None, **extra: Any) -> bool:
        """Save if ``score`` (a number, or a dict holding the monitored name) is among the best; True if saved."""
        self.step += 1
        value = _score_value(score, self.monitor)
        if value != value:  # nan
            return False
        if len(self.kept) >= self.keep and not self._better(value, self.kept[-1][0]):
            return False
        file = self._file_for(value, epoch)
        extra = {**extra, self.monitor: value, "mode": self.mode}
        save(file, model, optimizer, epoch, loader, self.file_mode, self.background, self, extra)
        self.kept = [(s, p) for s, p in self.kept if p != file]
        self.kept.append((value, file))
        self.kept.sort(key=lambda item: item[0], reverse=self.mode == "max")
        evicted = [p for _, p in self.kept[self.keep:]]
        self.kept = self.kept[:self.keep]
        for old in evicted:
            background_saves.wait(old)
            _remove_checkpoint(old)
        return True


def _remove_checkpoint(path: str) -> None:
    """Rank 0 removes the checkpoint and every rank's RNG file; other ranks remove their own RNG file.  Of a
    sharded checkpoint's directory only what a save put there goes (then the directory, if that left it empty).
    Nothing is removed through a link: a link at ``path`` (or at a save's name) is removed itself, through the
    descriptor of the folder it is in, and another user's file or folder is left."""
    rank, _ = rank_and_world_size()
    forget_saves(rng_path(os.path.abspath(path), rank))
    directory, base = os.path.split(path)
    try:
        parent = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        _remove_checkpoint_in(parent, base, rank)
    finally:
        os.close(parent)


def _remove_checkpoint_in(parent: int, base: str, rank: int) -> None:
    try:
        st = os.lstat(base, dir_fd=parent)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISDIR(st.st_mode):
        if rank != 0 or not safe_files.is_ours(st):
            return
        try:
            fd = safe_files.open_folder(base, dir_fd=parent)  # (a link put there since the lstat: ELOOP)
        except OSError:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHARDED_INDEX, dir_fd=fd)  # first: no half-removed checkpoint looks complete
            remove_saves(fd, keep=None)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(base, dir_fd=parent)  # (not if something of the user's is in it)
        return
    doomed = [f"{base}.rank{rank}.rng"]  # (rng_path's name)
    if rank == 0:
        doomed.append(base)
        with contextlib.suppress(OSError):
            doomed += [n for n in os.listdir(parent) if n.startswith(base + ".rank") and n.endswith(".rng")]
    for name in doomed:
        with contextlib.suppress(OSError):
            safe_files.remove(name, parent)
