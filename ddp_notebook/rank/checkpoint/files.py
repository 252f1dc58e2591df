"""Atomic files: written new (``O_EXCL``, never through a link), fsynced, renamed into place."""
from __future__ import annotations

import errno
import os
import sys
from typing import Any

import torch

from ...wire import safe_files


def atomic_save(obj: Any, path: str, file_mode: int) -> None:
    """Write to a new temporary file (``O_EXCL``, a random name: never through a link another user planted),
    flush, fsync, then rename over ``path``: readers see old or new, never half.  The file gets ``file_mode``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    handled_before = sys.exc_info()[1]  # (saved inside an except block: that error is not this save's)
    try:
        with safe_files.replace_atomically(path, file_mode) as f:
            torch.save(obj, f)
    except Exception as exc:
        full = _full_filesystem(exc, obj, path, handled_before)
        if full is not None:
            raise full from exc
        raise


class _SizeCounter:
    """A file that only counts what is written to it."""

    size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n

    def flush(self) -> None:
        pass


def _out_of_space(exc: BaseException | None, handled_before: BaseException | None) -> bool:
    """An ENOSPC in the save's chain: torch's zip writer raises its own ``unexpected pos`` RuntimeError while it
    handles the OSError of the write that did not fit.  The walk stops at ``handled_before``, the error being
    handled where the save was called, which is not the save's."""
    seen = set()
    while exc is not None and exc is not handled_before and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _full_filesystem(exc: Exception, obj: Any, path: str, handled_before: BaseException | None) -> OSError | None:
    """A clear ENOSPC error when a save failed for want of space; torch's own says ``unexpected pos``.  A write
    that failed with ENOSPC is named so even when the space is back by the time it is measured (another writer,
    another rank's temporary file, gave it back); otherwise the free space decides."""
    no_space = _out_of_space(exc, handled_before)
    if isinstance(exc, OSError) and not no_space:
        return None  # (permissions and the like: their own message is clear)
    try:
        counter = _SizeCounter()
        torch.save(obj, counter)
        stats = os.statvfs(os.path.dirname(path))
    except Exception:
        return None
    free = stats.f_bavail * stats.f_frsize  # measured after the partial file was removed
    if not no_space and counter.size <= free:
        return None
    return OSError(errno.ENOSPC, f"the filesystem of {path} is full: the checkpoint needs "
                                 f"{_size_text(counter.size)}, {_size_text(free)} are free there (the previous "
                                 f"file, if any, is left as it was)")


def _size_text(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"
