"""GPU reservations every ddp_notebook process on the machine respects: no two jobs get the same GPU.

One lock file per GPU (named by its UUID) in a folder all users share
(``/tmp/ddp_notebook-gpus``, sticky like ``/tmp``; ``$DDP_NOTEBOOK_RESERVATIONS``
moves it).  A job holds an exclusive ``flock`` on the files of its GPUs from
before its ranks start until it ends; the kernel holds the open files, so a
killed kernel releases its GPUs by itself (the kernel closes them on exit).  The
file's content says who holds it (user, process, notebook, since when), for the
messages and the picker; the lock, not the content, is the truth.
"""
from __future__ import annotations

import fcntl
import getpass
import json
import os
import socket
import sys
import time
from dataclasses import dataclass

DIR_ENV = "DDP_NOTEBOOK_RESERVATIONS"
DEFAULT_DIR = "/tmp/ddp_notebook-gpus"


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU's reservation."""

    user: str
    pid: int
    host: str
    what: str  # the notebook (Jupyter's session name) or the script
    since: float

    def describe(self) -> str:
        when = time.strftime("%H:%M", time.localtime(self.since))
        return f"{self.user}'s {self.what} (pid {self.pid}) since {when}"


def folder() -> str:
    """The shared folder of lock files, made (sticky, writable by all) on first use."""
    path = os.environ.get(DIR_ENV) or DEFAULT_DIR
    if not os.path.isdir(path):
        try:
            os.makedirs(path, exist_ok=True)
            os.chmod(path, 0o1777)  # every user may add a lock file; only its owner may remove it
        except PermissionError:
            pass  # made by another user meanwhile
    return path


def _path(uuid: str) -> str:
    return os.path.join(folder(), f"{uuid}.lock")


def _open(uuid: str) -> int:
    fd = os.open(_path(uuid), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        os.fchmod(fd, 0o666)  # other users lock the same file (the umask may have narrowed it)
    except PermissionError:
        pass  # another user's file: already open to all
    return fd


def _read_holder(fd: int) -> Holder | None:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return Holder(**json.loads(os.read(fd, 4096).decode()))
    except (OSError, ValueError, TypeError):
        return None  # being written this moment


def _whoami() -> Holder:
    what = os.environ.get("JPY_SESSION_NAME") or (sys.argv[0] if sys.argv and sys.argv[0] else "python")
    return Holder(user=getpass.getuser(), pid=os.getpid(), host=socket.gethostname(), what=os.path.basename(what),
                  since=time.time())


class Reservation:
    """The GPUs one job holds; :meth:`release` (or the process's end) frees them."""

    def __init__(self, fds: dict[str, int]):
        self._fds = fds

    @property
    def uuids(self) -> list[str]:
        return list(self._fds)

    def release(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)  # closing the file drops its lock

    def __del__(self):
        self.release()

    def __repr__(self) -> str:
        return f"Reservation({self.uuids})"


def _try_lock(uuid: str) -> int | None:
    """The locked file of ``uuid``, or None when another holds it."""
    fd = _open(uuid)
    for attempt in range(3):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            time.sleep(0.005)  # another process may be only looking (holders(): a shared lock for a moment)
    os.close(fd)
    return None


def _claim(fd: int, me: Holder) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me.__dict__).encode(), 0)


def holders(uuids: list[str]) -> dict[str, Holder | None]:
    """Who holds each GPU (None: free).  A GPU held by this process counts as held."""
    found = {}
    for uuid in uuids:
        fd = _open(uuid)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                found[uuid] = None
            except BlockingIOError:
                found[uuid] = _read_holder(fd) or Holder("someone", 0, "", "a job starting", time.time())
        finally:
            os.close(fd)
    return found


def reserve(uuids: list[str]) -> tuple[Reservation, dict[str, Holder]]:
    """Hold every one of ``uuids`` that no one else holds: (the reservation, who holds the others)."""
    me, fds, taken = _whoami(), {}, []
    for uuid in uuids:
        fd = _try_lock(uuid)
        if fd is None:
            taken.append(uuid)
        else:
            fds[uuid] = fd
    for fd in fds.values():
        _claim(fd, me)
    held = holders(taken) if taken else {}
    return Reservation(fds), {u: h for u, h in held.items() if h is not None}


def reserve_any(candidates: list[str], n: int) -> Reservation | None:
    """The first ``n`` of ``candidates`` (in order of preference) that no one holds; None when fewer are free.

    Each GPU is taken by its lock, so two processes choosing at the same moment never get the same one."""
    me, fds = _whoami(), {}
    for uuid in candidates:
        if len(fds) == n:
            break
        fd = _try_lock(uuid)
        if fd is not None:
            fds[uuid] = fd
    if len(fds) < n:
        for fd in fds.values():
            os.close(fd)
        return None
    for fd in fds.values():
        _claim(fd, me)
    return Reservation(fds)


class WaitingLine:
    """First come, first served between processes waiting for GPUs (``--wait``): each holds a ticket, a locked
    file named by when it began waiting; a process's turn comes when no older ticket is held.  A killed
    waiter's ticket is unlocked and so skipped."""

    def __init__(self):
        self._name = f"waiting-{time.time_ns():020d}-{os.getpid()}"
        self._fd = _open(self._name)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def my_turn(self) -> bool:
        for name in sorted(n[:-len(".lock")] for n in os.listdir(folder())
                           if n.startswith("waiting-") and n.endswith(".lock")):
            if name >= self._name:
                return True
            try:
                fd = os.open(_path(name), os.O_RDONLY)
            except FileNotFoundError:
                continue  # it left the line this moment
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # an older waiter is still waiting
            finally:
                os.close(fd)
            try:
                os.unlink(_path(name))  # a waiter that was killed; only its owner may remove it
            except OSError:
                pass
        return True

    def leave(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(_path(self._name))
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "WaitingLine":
        return self

    def __exit__(self, *exc) -> None:
        self.leave()
