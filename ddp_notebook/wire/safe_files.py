"""Files made, replaced and removed in a folder other users may write in (a group project folder, 0777 or
group-writable and often not sticky): never through a link one of them planted, never at a name they can guess,
never a file or folder of theirs removed as if it were ours.

What another user can still do there, and nothing here prevents: remove or rename what is in the folder (a folder
without the sticky bit lets anyone who can write in it do so), and so put their own file at a name after it was
written.  :func:`replace_atomically` says so when it happens before it returns.

Shared by both sides (the rank side's checkpoints, the engine's files); standard library only.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import tempfile
from typing import BinaryIO, Callable, Iterator

# A folder opened never through a link at its last component, never handed to a child process.
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
DEFAULT_MODE = 0o600


def folder_mode(file_mode: int) -> int:
    """The mode of a folder whose files get ``file_mode``: whoever may read them may also enter it (0600 -> 0700,
    0640 -> 0750, 0644 -> 0755)."""
    return file_mode | (file_mode & 0o444) >> 2


def temp_prefix(path: str) -> str:
    """The start of the name of every temporary file made for ``path`` on this host by this process: the host and
    pid tell a dead process's leftovers (:func:`remove_stale_temps`); the rest of the name is random."""
    return f".{os.path.basename(path)}.tmp-{socket.gethostname()}-{os.getpid()}-"


def new_temp(path: str, mode: int = DEFAULT_MODE) -> tuple[int, str]:
    """A new file of this process's beside ``path``: (its descriptor, its path).  Made by
    :func:`tempfile.mkstemp`: ``O_EXCL`` (never through a link or into a file someone put there first), a random
    name, mode 0600, then ``mode`` (``fchmod``, so the umask does not change it)."""
    fd, temp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=temp_prefix(path))
    if mode != DEFAULT_MODE:
        os.fchmod(fd, mode)
    return fd, temp


def is_ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def remove_stale_temps(path: str) -> None:
    """Remove the temporary files left beside ``path`` by processes of this host that died while writing it: only
    plain files of this user's (``lstat``: a link is never followed, another user's file never removed)."""
    base = temp_prefix(path).rsplit("-", 2)[0] + "-"  # .NAME.tmp-HOST-
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in os.listdir(fd):
            if not name.startswith(base):
                continue
            pid_text = name[len(base):].split("-", 1)[0]
            if not pid_text.isdigit() or int(pid_text) == os.getpid() or _alive(int(pid_text)):
                continue
            try:
                st = os.lstat(name, dir_fd=fd)
                if stat.S_ISREG(st.st_mode) and is_ours(st):
                    os.unlink(name, dir_fd=fd)
            except OSError:
                pass
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's
    return True


def fsync_folder(path: str) -> None:
    """Make a rename in ``path`` durable (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class ReplacedError(OSError):
    """The file at a path just written is not the one written there: another user put theirs in its place."""


@contextlib.contextmanager
def replace_atomically(path: str, mode: int = DEFAULT_MODE,
                       before_rename: Callable[[str], None] | None = None) -> Iterator[BinaryIO]:
    """Write ``path`` whole or not at all: yields a new temporary file (:func:`new_temp`, ``mode``); once the block
    ends it is flushed, fsynced and renamed over ``path`` (a link at ``path`` is replaced itself, never followed).
    On an error the temporary file is removed and ``path`` left as it was.  ``before_rename(temp)`` runs between
    the fsync and the rename.  Raises :class:`ReplacedError` when the file at ``path`` after the rename is not the
    one written (another user replaced it, in a folder that lets them)."""
    remove_stale_temps(path)
    fd, temp = new_temp(path, mode)
    with os.fdopen(fd, "wb") as f:
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
            if before_rename is not None:
                before_rename(temp)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                written = os.fstat(f.fileno())
                st = os.lstat(temp)
                if (st.st_dev, st.st_ino) == (written.st_dev, written.st_ino):
                    os.unlink(temp)
            raise
        written = os.fstat(f.fileno())
    fsync_folder(os.path.dirname(path) or ".")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is None or (st.st_dev, st.st_ino) != (written.st_dev, written.st_ino):
        raise ReplacedError(f"{path} was written, and then replaced or removed by someone else before this save "
                            f"returned: other users may write in {os.path.dirname(path)}; save into a folder only "
                            f"you can write in")


def open_folder(name: str, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``name`` (in the folder ``dir_fd``, else from here): OSError (ELOOP, ENOTDIR)
    when it is a link or not a folder."""
    return os.open(name, FOLDER_FLAGS, dir_fd=dir_fd)


def make_folder(path: str, mode: int) -> bool:
    """Make the folder ``path`` with ``mode`` (not changed by the umask); True if made, False if a folder of this
    user's is already there.  Raises FileExistsError naming what is there otherwise (a link, a file, another
    user's folder)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and is_ours(st):
            return False
        raise FileExistsError(f"{path} is {describe(st)}, not a folder of yours: not written into") from None
    if mode != 0o700:
        os.chmod(path, mode)
    return True


def describe(st: os.stat_result) -> str:
    """What a ``stat`` result is, and whose: 'a symbolic link of alice's'."""
    kind = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO",
            stat.S_IFSOCK: "a socket", stat.S_IFREG: "a file"}.get(stat.S_IFMT(st.st_mode), "a device")
    return f"{kind} of yours" if is_ours(st) else f"{kind} of {user_name(st.st_uid)}'s"


def user_name(uid: int) -> str:
    """The name of the user ``uid``, or ``uid N`` when it has none."""
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def remove(name: str, dir_fd: int) -> bool:
    """Remove ``name`` from the folder ``dir_fd`` without following a link: a link is unlinked itself; a file of
    this user's is unlinked, a folder of this user's removed with everything in it (``shutil.rmtree`` through
    descriptors, which never follows a link inside).  Another user's file or folder is left; True when something
    was removed."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode) or (is_ours(st) and not stat.S_ISDIR(st.st_mode)):
        os.unlink(name, dir_fd=dir_fd)
        return True
    if not (stat.S_ISDIR(st.st_mode) and is_ours(st)):
        return False
    shutil.rmtree(name, dir_fd=dir_fd)  # lstat, then open without following, then compares the two
    return True
