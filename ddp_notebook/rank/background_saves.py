"""Checkpoints written in the background (``save_checkpoint(..., background=True)``): the writes in flight, their
errors, and the CPU staging copies they are written from.

A background save captures the state at its call into a staging copy in CPU memory (one per path, or per
``BestCheckpoint``, reused by its next save: ``torch.distributed.checkpoint``'s :class:`DefaultStager`, which keeps a
staged storage for each storage of the state) and writes that copy in a thread of its own.  At most one save per path
is in flight: the next save of the path, a load or resume of it, and the end of the task wait for it.  An error in the
write is kept and raised in the rank at its next save (of any path) or at the end of the task, naming the path; it is
raised once.

Rank side; torch is imported only when a save stages something (the worker imports this module to wait at a task's
end).
"""
from __future__ import annotations

import atexit
import sys
import threading
import time
from typing import Any, Callable, Hashable

from ..wire import protocol
from . import context


# Memory a background save leaves to everything else when it checks that its staging copy fits.
HEADROOM_BYTES = 256 * 2**20

_lock = threading.Lock()
_in_flight: dict[str, "BackgroundSave"] = {}  # by path: the latest save of each path, until its error is raised
_stagers: dict[Hashable, tuple[Any, int]] = {}  # staging key -> (DefaultStager, bytes it holds)
_last_of_key: dict[Hashable, "BackgroundSave"] = {}  # staging key -> the save written from its staging copy


class BackgroundSaveError(RuntimeError):
    """A checkpoint written in the background could not be written (disk full, permissions...): the checkpoint at its
    path is the previous one."""


class StagingMemoryError(MemoryError):
    """A background save's staging copy does not fit in the memory left: nothing was saved (save with
    ``background=False``, or free memory)."""


class BackgroundSave:
    """One checkpoint being written in a thread of its own."""

    def __init__(self, path: str, write: Callable[[], None], blocked_s: float, tell: bool):
        self.path = path
        self.tell = tell  # on the dashboard: rank 0's saves
        self.blocked_s = blocked_s  # how long the training waited for the state to be captured
        self.started = time.monotonic()
        self.error: BaseException | None = None
        self.reported = False
        self._write = write
        self._thread = threading.Thread(target=self._run, name=f"ddp_notebook checkpoint {path}", daemon=True)

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # noqa: BLE001 - raised in the training thread at its next save
            self.error = exc
        finally:
            self._write = None  # (its staged state goes)
            self._tell(time.monotonic() - self.started)

    def _tell(self, written_s: float | None) -> None:
        """Show the save on the dashboard: started (``written_s`` None), written, or failed."""
        if not self.tell:
            return
        ctx = context.current()
        task = {"task": ctx.task_id} if ctx is not None and ctx.task is not None else {}
        error = f"{type(self.error).__name__}: {self.error}" if self.error is not None else None
        context.send(protocol.SAVING, {**task, "path": self.path, "blocked_s": self.blocked_s,
                                       "written_s": written_s, "error": error})

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()

    def failure(self) -> BackgroundSaveError | None:
        """The error to raise for this save, once; None when it succeeded or its error was already raised."""
        if self.error is None or self.reported:
            return None
        self.reported = True
        error = BackgroundSaveError(f"the background save of {self.path} failed: {type(self.error).__name__}: "
                                    f"{self.error} (the checkpoint there is the one saved before it)")
        error.__cause__ = self.error
        return error


def start(path: str, key: Hashable, write: Callable[[], None], blocked_s: float, tell: bool) -> BackgroundSave:
    """Run ``write()`` in a new thread as the background save of ``path``, from the staging copy of ``key`` (call
    :func:`wait` first); ``tell``: show it on the dashboard (``protocol.SAVING``)."""
    save = BackgroundSave(path, write, blocked_s, tell)
    with _lock:
        _in_flight[path] = save
        _last_of_key[key] = save
    save._tell(None)
    save._thread.start()
    return save


def in_flight(path: str) -> BackgroundSave | None:
    save = _in_flight.get(path)
    return save if save is not None and not save.done() else None


def paths() -> list[str]:
    """The paths of the background saves in flight, or failed and not raised yet."""
    return list(_in_flight)


def wait(path: str) -> None:
    """Wait for the background save of ``path``, if one is in flight; raise its error if it failed."""
    save = _in_flight.get(path)
    if save is None:
        return
    save.wait()
    _raise([save])


def raise_failures() -> None:
    """Raise the error of any background save that has failed (of any path) and not been raised yet."""
    _raise([s for s in list(_in_flight.values()) if s.done()])


def finish(raise_errors: bool = True) -> list[str]:
    """Wait for every background save, and free the staging copies (the end of a task).  Raises the first failure
    (naming the others), or with ``raise_errors=False`` returns their messages."""
    saves = list(_in_flight.values())
    for save in saves:
        save.wait()
    close_staging()
    if raise_errors:
        _raise(saves)
        return []
    messages = [str(f) for f in (s.failure() for s in saves) if f is not None]
    _forget_finished()
    return messages


def _raise(saves: list[BackgroundSave]) -> None:
    failures = [f for f in (s.failure() for s in saves) if f is not None]
    _forget_finished()
    if failures:
        if len(failures) > 1:
            failures[0].args = (f"{failures[0].args[0]}; also: " + "; ".join(str(f) for f in failures[1:]),)
        raise failures[0]


def _forget_finished() -> None:
    with _lock:
        for path, save in list(_in_flight.items()):
            if save.done() and (save.error is None or save.reported):
                del _in_flight[path]


# -- staging -------------------------------------------------------------------------------------

def _tensors(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", None)  # a DTensor: its shard is what is staged
        yield local if isinstance(local, torch.Tensor) else value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def state_bytes(value: Any) -> int:
    """Bytes of the storages of every tensor in ``value`` (each storage once): what staging it copies."""
    seen: dict[int, int] = {}
    for t in _tensors(value):
        storage = t.untyped_storage()
        seen[storage.data_ptr() if storage.data_ptr() else id(storage)] = storage.nbytes()
    return sum(seen.values())


def available_memory() -> int:
    """Bytes this process may still take: the machine's available memory, or less under a cgroup limit."""
    import psutil

    available = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                available = min(available, int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return available


def check_fits(key: Hashable, path: str, state: Any) -> None:
    """Refuse (:class:`StagingMemoryError`) a staging copy of ``state`` that does not fit in the memory left (less
    :data:`HEADROOM_BYTES`), counting what the staging memory of ``key`` already holds."""
    needed = state_bytes(state)
    _, held = _stagers.get(key, (None, 0))
    if needed <= held:
        return
    available = available_memory()
    if needed - held + HEADROOM_BYTES > available:
        raise StagingMemoryError(
            f"save_checkpoint({path!r}, background=True) needs {_size_text(needed)} of CPU memory for its "
            f"staging copy of this rank's state ({_size_text(held)} of it already held), and "
            f"{_size_text(available)} are available, of which {_size_text(HEADROOM_BYTES)} are left to the "
            f"rest: nothing was saved; save with background=False (it needs no copy), or free memory")


def stage(key: Hashable, path: str, state: Any) -> Any:
    """A CPU copy of ``state`` (tensors copied, the rest deep-copied) in the staging memory of ``key``, reused from
    its last save: pinned when CUDA is in use.  Refuses (:class:`StagingMemoryError`) a copy that does not fit."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    last = _last_of_key.get(key)
    if last is not None:
        last.wait()  # (its copy is about to be overwritten; its error is raised by its path)
    check_fits(key, path, state)
    stager, held = _stagers.get(key, (None, 0))
    if stager is None:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
    _stagers[key] = (stager, max(state_bytes(state), held))
    return stager.stage(state)


def close_staging() -> None:
    """Free every staging copy (none may be in flight)."""
    _last_of_key.clear()
    while _stagers:
        _, (stager, _) = _stagers.popitem()
        stager.close()


def _size_text(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else \
        f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


@atexit.register
def _at_exit() -> None:
    """A script (not a rank of a notebook's job, whose task end waits) waits for its saves as it exits, and says
    what failed."""
    if not _in_flight:
        return
    for message in finish(raise_errors=False):
        print(f"ddp_notebook: {message}", file=sys.stderr, flush=True)

