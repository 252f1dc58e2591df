"""A rank's stdout and stderr reach the notebook in the order the rank wrote them.

They are two pipes, and the notebook reads whichever has something: a tqdm bar's
last line (stderr) and the ``print`` right after it (stdout) are both there by
the time it looks, and it cannot tell which came first.  So a write to one of
``sys.stdout``/``sys.stderr`` after the other waits until the notebook has read
what the other holds (``FIONREAD`` says 0), at most ``WAIT_S``: nothing to wait
for while a rank writes to one stream only, and at most one wait per switch.
Output written to the descriptors directly (C code, child processes) is not
ordered.
"""
from __future__ import annotations

import array
import fcntl
import io
import os
import stat
import sys
import termios
import time

WAIT_S = 0.05  # a notebook that does not read (busy, or gone) delays each switch by at most this


class _InOrder(io.FileIO):
    """File descriptor 1 or 2 of a rank, written after the other one's pipe is read empty."""

    last_written = None  # the _InOrder written to last (shared by the two)

    def __init__(self, fd: int, other: int):
        super().__init__(fd, "w", closefd=False)
        self._other = other

    def write(self, data, _write=io.FileIO.write) -> int:  # (every print: kept short)
        if _InOrder.last_written is not self:
            _InOrder.last_written = self
            _wait_read(self._other)
        return _write(self, data)


def _unread(fd: int) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def _wait_read(fd: int) -> None:
    deadline, pause = time.monotonic() + WAIT_S, 0.0001
    try:
        while _unread(fd) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.002)
    except OSError:
        pass


def keep_in_order() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` write in order (see the module docstring) when they are two pipes, as
    under the notebook; otherwise leave them."""
    try:
        kinds = [os.fstat(fd) for fd in (1, 2)]
    except OSError:
        return
    if not all(stat.S_ISFIFO(kind.st_mode) for kind in kinds) or kinds[0].st_ino == kinds[1].st_ino:
        return
    for name, fd, other in (("stdout", 1, 2), ("stderr", 2, 1)):
        old = getattr(sys, name)
        try:
            if old.fileno() != fd:
                continue
        except (AttributeError, OSError, ValueError):  # (io.UnsupportedOperation is both of the last two)
            continue
        setattr(sys, name, io.TextIOWrapper(_InOrder(fd, other), encoding=old.encoding, errors=old.errors,
                                            line_buffering=old.line_buffering, write_through=True))
