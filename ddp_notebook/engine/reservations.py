"""GPU reservations every ddp_notebook process on the machine respects: no two jobs get the same GPU.

One lock file per GPU (named by its UUID) in a folder all users share
(``/tmp/ddp_notebook-gpus``, sticky like ``/tmp``; ``$DDP_NOTEBOOK_RESERVATIONS``
moves it).  A job holds an exclusive ``flock`` on the files of its GPUs from
before its ranks start until it ends; the kernel holds the open files, so a
killed kernel releases its GPUs by itself (the kernel closes them on exit).

The other users of the machine are not trusted (docs/faults-and-guarantees.md,
"Security model").  So the folder is used only when root or this user owns it
(and every folder above it), and no file in it is followed, truncated or
written unless this process created it: a lock file is only opened (never
through a link, never waiting on a FIFO) and locked.  Who holds a GPU is said
by a second file, ``<uuid>.held-<random>``, that each holder creates for
itself, writes and locks for as long as it holds the GPU; as only its owner can
remove it from the sticky folder, a lock file that another user unlinks under a
holder does not let a second job take the GPU: a taker checks for a held one
after it has locked.  The locks, not the files' contents, are the truth; the
user a message names is the file's owner, not what the file says.
"""
from __future__ import annotations

import fcntl
import json
import os
import secrets
import socket
import stat
import sys
import time
from dataclasses import dataclass

from ..wire import safe_files
from ..wire.errors import LaunchError

DIR_ENV = "DDP_NOTEBOOK_RESERVATIONS"
DEFAULT_DIR = "/tmp/ddp_notebook-gpus"
LOCK_SUFFIX = ".lock"
HELD_MARK = ".held-"  # <uuid>.held-<random>: who holds the GPU, owned and locked by the holder
STALE_HELD_S = 60.0  # an unlocked holder file of ours this old is a killed process's, removed by the next taker
_OPEN_FLAGS = safe_files.OPEN_FLAGS  # never through a link, never waiting on a FIFO, never to a child process
_TRIES = 3


@dataclass(frozen=True)
class Holder:
    """Who holds a GPU's reservation (``pid`` 0 and ``since`` 0 where they are not known)."""

    user: str
    pid: int
    host: str
    what: str  # the notebook (Jupyter's session name), the script, or what is in the way
    since: float

    def describe(self) -> str:
        pid = f" (pid {self.pid})" if self.pid else ""
        when = f" since {time.strftime('%H:%M', time.localtime(self.since))}" if self.since else ""
        return f"{self.user}'s {self.what}{pid}{when}"


def _kind(mode: int) -> str:
    return {stat.S_IFLNK: "symbolic link", stat.S_IFIFO: "FIFO", stat.S_IFDIR: "folder", stat.S_IFSOCK: "socket",
            stat.S_IFCHR: "device", stat.S_IFBLK: "device", stat.S_IFREG: "file"}.get(stat.S_IFMT(mode), "file")


def folder() -> str:
    """The shared folder of lock files, made (sticky, writable by all) on first use; refused (LaunchError) unless
    root or this user owns it and every folder above it, and no other user can replace what is in it."""
    path = os.path.abspath(os.environ.get(DIR_ENV) or DEFAULT_DIR)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)  # opened up below, once it is known to be the folder just made
        made = True
    except FileExistsError:
        made = False
    except OSError as exc:
        raise LaunchError(f"GPU reservations: cannot create the folder {path}: {exc.strerror}; set "
                          f"{DIR_ENV} to a folder of your own") from None
    fd = _open_folder(path)
    try:
        if made:
            os.fchmod(fd, 0o1777)  # every user may add a lock file; only its owner may remove it
    finally:
        os.close(fd)
    return path


def _open_folder(path: str) -> int:
    """The folder, opened, once it and every folder above it is trusted (see :func:`folder`)."""
    me = os.geteuid()
    given = path.split(os.sep)
    for i in range(2, len(given) + 1):  # a link on the way is followed only when root or this user made it
        here = os.sep.join(given[:i])
        st = os.lstat(here)
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in (0, me):
            raise LaunchError(f"GPU reservations: {here} is a symbolic link made by {safe_files.user_name(st.st_uid)}, not by "
                              f"root or you ({safe_files.user_name(me)}); remove it, or set {DIR_ENV} to a folder of your own")
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for i in range(1, len(parts) + 1):
        here = os.sep.join(parts[:i]) or os.sep
        st = os.lstat(here)
        culprit = None
        if st.st_uid not in (0, me):
            culprit = f"it is owned by {safe_files.user_name(st.st_uid)}"
        elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            culprit = "other users may write in it and it is not sticky (they could replace its lock files)"
        if culprit is not None:
            what = "the folder of GPU reservations" if here == real else f"{here}, a folder above the GPU " \
                                                                        f"reservations' {real},"
            raise LaunchError(
                f"GPU reservations: {what} is not trusted: {culprit}, not by root or you ({safe_files.user_name(me)}). Ask an "
                f"administrator to create it for every user (as root: install -d -m 1777 {real}), or set {DIR_ENV} "
                f"to a folder of your own")
    fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | _OPEN_FLAGS)
    opened = os.fstat(fd)
    if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise LaunchError(f"GPU reservations: the folder {real} was replaced while it was opened; try again")
    return fd


class _Folder:
    """The reservations folder, opened for one operation (every file in it is opened relative to it)."""

    def __enter__(self) -> "_Folder":
        self.path = folder()
        self.fd = _open_folder(self.path)
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)

    def names(self) -> list[str]:
        return os.listdir(self.fd)


class _InTheWay(Exception):
    """Not a lock file of ours to use: a link, a FIFO, a file we may not open; ``holder`` names its owner."""

    def __init__(self, holder: Holder):
        super().__init__(holder.describe())
        self.holder = holder


def _in_the_way(where: _Folder, name: str, why: str = "") -> _InTheWay:
    try:
        st = os.lstat(name, dir_fd=where.fd)
        user, kind = safe_files.user_name(st.st_uid), _kind(st.st_mode)
    except OSError:
        user, kind = "someone", "file"
    return _InTheWay(Holder(user, 0, "", f"{kind} in place of the lock file {os.path.join(where.path, name)}"
                                         + (f" ({why})" if why else ""), 0))


def _open_lock_file(where: _Folder, name: str, create: bool = True) -> int | None:
    """The lock file ``name``, opened; made (readable by all, so every user can lock it) when missing and
    ``create``, else None.  A link, a FIFO, anything not a plain file, is in the way."""
    fd, made = None, False
    if create:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644, dir_fd=where.fd)
            made = True
        except FileExistsError:
            pass
    if fd is None:
        try:
            fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=where.fd)
        except FileNotFoundError:
            return _open_lock_file(where, name) if create else None  # removed this moment: make it
        except OSError as exc:  # ELOOP: a link; EACCES: another user's file we may not read
            raise _in_the_way(where, name, exc.strerror) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _in_the_way(where, name)
    if made:
        os.fchmod(fd, 0o644)  # ours, just made: the umask may have hidden it from the other users
    return fd


def _still_there(where: _Folder, name: str, fd: int) -> bool:
    """Whether ``name`` still names the file ``fd`` is open on (not unlinked or replaced since it was opened)."""
    try:
        st = os.stat(name, dir_fd=where.fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)


def _lock(fd: int, how: int) -> bool:
    for attempt in range(_TRIES):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.005)  # another process may be only looking (a shared lock for a moment)
    return False


def _whoami() -> Holder:
    what = os.environ.get("JPY_SESSION_NAME") or (sys.argv[0] if sys.argv and sys.argv[0] else "python")
    return Holder(user=safe_files.user_name(os.geteuid()), pid=os.getpid(), host=socket.gethostname(), what=os.path.basename(what),
                  since=time.time())


def _held_by(where: _Folder, uuid: str, names: list[str], mine: str | None = None) -> Holder | None:
    """The holder of ``uuid`` that a locked ``<uuid>.held-*`` file names (other than ``mine``); removes our own
    that a killed process left."""
    for name in names:
        if not name.startswith(uuid + HELD_MARK) or name == mine:
            continue
        try:
            fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=where.fd)
        except OSError:
            continue  # gone this moment, or not one we can read: not a holder's
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(fd, st.st_uid)
            if st.st_uid == os.geteuid() and time.time() - st.st_mtime > STALE_HELD_S:
                try:
                    os.unlink(name, dir_fd=where.fd)
                except OSError:
                    pass
        finally:
            os.close(fd)
    return None


def _read_holder(fd: int, uid: int) -> Holder:
    """What a holder file says, under the name of the user who owns it (whatever it says)."""
    try:
        said = json.loads(os.pread(fd, 4096, 0).decode())
        return Holder(user=safe_files.user_name(uid), pid=int(said["pid"]), host=str(said["host"]), what=str(said["what"]),
                      since=float(said["since"]))
    except (OSError, ValueError, TypeError, KeyError):
        return Holder(safe_files.user_name(uid), 0, "", "job starting", time.time())  # being written this moment


def _flock_holder(fd: int) -> Holder | None:
    """Who holds the lock on ``fd``'s file, from the kernel's table of locks (Linux): for a holder that wrote
    no holder file, such as ``flock FILE sleep inf``."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[3] == "WRITE":
            pid = int(fields[4])
            try:
                import psutil

                proc = psutil.Process(pid)
                return Holder(proc.username(), pid, socket.gethostname(), proc.name(), proc.create_time())
            except (ImportError, psutil.Error):
                return Holder("someone", pid, "", "process", 0)
    return None


class Reservation:
    """The GPUs one job holds; :meth:`release` (or the process's end) frees them."""

    def __init__(self, held: dict[str, tuple[int, int, str]], where: str):
        self._held = held  # uuid -> (lock file, holder file, the holder file's name)
        self._folder = where

    @property
    def uuids(self) -> list[str]:
        return list(self._held)

    def release(self) -> None:
        held, self._held = self._held, {}
        for lock_fd, held_fd, held_name in held.values():
            try:
                os.unlink(os.path.join(self._folder, held_name))  # ours: only we can remove it
            except OSError:
                pass
            os.close(held_fd)
            os.close(lock_fd)  # closing the file drops its lock

    def __del__(self):
        self.release()

    def __repr__(self) -> str:
        return f"Reservation({self.uuids})"


def _new_holder_file(where: _Folder, uuid: str, me: Holder) -> tuple[int, str]:
    """A holder file of our own for ``uuid``, written and locked: (its descriptor, its name)."""
    while True:
        name = f"{uuid}{HELD_MARK}{secrets.token_hex(8)}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644, dir_fd=where.fd)
            break
        except FileExistsError:
            continue
    os.fchmod(fd, 0o644)  # ours, just made: readable by the users it tells who holds the GPU
    os.write(fd, json.dumps(me.__dict__).encode())
    if not _lock(fd, fcntl.LOCK_EX):  # only a reader holding a shared lock on a file it found a moment ago
        os.close(fd)
        os.unlink(name, dir_fd=where.fd)
        raise _InTheWay(Holder("someone", 0, "", f"reader of {os.path.join(where.path, name)}", 0))
    return fd, name


def _try_lock(where: _Folder, uuid: str, me: Holder) -> tuple[int, int, str] | None:
    """``uuid`` held for this process: (lock file, holder file, its name); None when another holds it."""
    name = uuid + LOCK_SUFFIX
    for attempt in range(_TRIES):
        fd = _open_lock_file(where, name)
        if not _lock(fd, fcntl.LOCK_EX):
            os.close(fd)
            return None
        if not _still_there(where, name, fd):
            os.close(fd)  # unlinked (or replaced) since it was opened: a lock nobody else sees
            continue
        try:
            held_fd, held_name = _new_holder_file(where, uuid, me)
        except BaseException:
            os.close(fd)
            raise
        # Another holder's file, still locked: its lock file was unlinked under it and this is a new one.
        if _held_by(where, uuid, where.names(), mine=held_name) is not None:
            os.unlink(held_name, dir_fd=where.fd)
            os.close(held_fd)
            os.close(fd)
            return None
        return fd, held_fd, held_name
    return None


def _holder(where: _Folder, uuid: str, names: list[str]) -> Holder | None:
    name = uuid + LOCK_SUFFIX
    try:
        fd = _open_lock_file(where, name, create=False)
    except _InTheWay as exc:
        return exc.holder
    held = _held_by(where, uuid, names)
    if held is not None or fd is None:
        if fd is not None:
            os.close(fd)
        return held
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None
    except BlockingIOError:
        return _flock_holder(fd) or Holder("someone", 0, "", "job starting", time.time())
    finally:
        os.close(fd)


def holders(uuids: list[str]) -> dict[str, Holder | None]:
    """Who holds each GPU (None: free).  A GPU held by this process counts as held."""
    with _Folder() as where:
        names = where.names()
        return {uuid: _holder(where, uuid, names) for uuid in uuids}


def _take(where: _Folder, uuid: str, me: Holder) -> tuple[int, int, str] | None:
    try:
        return _try_lock(where, uuid, me)
    except _InTheWay:
        return None  # holders() names it


def reserve(uuids: list[str]) -> tuple[Reservation, dict[str, Holder]]:
    """Hold every one of ``uuids`` that no one else holds: (the reservation, who holds the others)."""
    me, held, taken = _whoami(), {}, []
    with _Folder() as where:
        for uuid in uuids:
            got = _take(where, uuid, me)
            if got is None:
                taken.append(uuid)
            else:
                held[uuid] = got
        reservation = Reservation(held, where.path)
    found = holders(taken) if taken else {}
    return reservation, {u: h for u, h in found.items() if h is not None}


def reserve_any(candidates: list[str], n: int) -> Reservation | None:
    """The first ``n`` of ``candidates`` (in order of preference) that no one holds; None when fewer are free.

    Each GPU is taken by its lock, so two processes choosing at the same moment never get the same one."""
    me, held = _whoami(), {}
    with _Folder() as where:
        for uuid in candidates:
            if len(held) == n:
                break
            got = _take(where, uuid, me)
            if got is not None:
                held[uuid] = got
        reservation = Reservation(held, where.path)
    if len(held) < n:
        reservation.release()
        return None
    return reservation


class WaitingLine:
    """First come, first served between processes waiting for GPUs (``--wait``): each holds a ticket, a locked
    file named by when it began waiting; a process's turn comes when no older ticket is held.  A killed
    waiter's ticket is unlocked and so skipped; a ticket that is not a plain file is no waiter's.  ``ahead``:
    who holds the oldest ticket before this one, when it is not this one's turn."""

    def __init__(self):
        self.ahead: Holder | None = None
        with _Folder() as where:
            self._folder = where.path
            while True:
                self._name = f"waiting-{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}{LOCK_SUFFIX}"
                try:
                    self._fd = os.open(self._name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o644,
                                       dir_fd=where.fd)
                    break
                except FileExistsError:
                    continue
            os.fchmod(self._fd, 0o644)  # ours, just made: other waiters lock it to see it is held
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def my_turn(self) -> bool:
        self.ahead = None
        with _Folder() as where:
            for name in sorted(n for n in where.names() if n.startswith("waiting-") and n.endswith(LOCK_SUFFIX)):
                if name >= self._name:
                    return True
                try:
                    fd = os.open(name, os.O_RDONLY | _OPEN_FLAGS, dir_fd=where.fd)
                except OSError:
                    continue  # it left the line this moment; or a link, or not ours to read: no waiter's
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode):
                        continue  # a FIFO or a device: nobody waits behind it
                    try:
                        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        pid = name.split("-")[2] if name.count("-") >= 2 else "0"
                        self.ahead = Holder(safe_files.user_name(st.st_uid), int(pid) if pid.isdigit() else 0, "",
                                            "place in the --wait line", st.st_mtime)
                        return False  # an older waiter is still waiting
                finally:
                    os.close(fd)
                try:
                    os.unlink(name, dir_fd=where.fd)  # a waiter that was killed; only its owner may remove it
                except OSError:
                    pass
        return True

    def leave(self) -> None:
        if self._fd is not None:
            try:
                os.unlink(os.path.join(self._folder, self._name))
            except OSError:
                pass
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "WaitingLine":
        return self

    def __exit__(self, *exc) -> None:
        self.leave()
