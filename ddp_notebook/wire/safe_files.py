"""Files of this user's in a folder other users may write in (a group project folder, 0777 or group-writable and
often not sticky): made, replaced, opened and removed never through a link one of them planted, never at a name they
can guess, never waiting on a FIFO, never a file or folder of theirs used or removed as if it were ours.

A name in such a folder may be anything another user put there first: a symbolic link to a private file of yours
(written through, it would get what was meant for the log), a FIFO (opened, it would wait forever), a hard link, a
file of theirs.  :func:`open_own_file` opens a name only when it is a regular file of this user's, with no other
name, made 0600 when it is new; anything else is refused with :class:`NotOwnFileError`, which says what is there
and whose it is.  :func:`open_folder` opens a folder once, never through a link, so that every file read from it is
in the folder that was checked.  :func:`new_temp` and :func:`replace_atomically` write a file under a name no one can
guess and give it its name at once; :func:`remove` removes through a folder's descriptor.

What another user who may write in the folder can still do, and nothing here prevents: remove or rename what is in
it (a folder without the sticky bit lets anyone who can write in it do so), and so put their own file at a name
after it was written (refused then, not followed; :func:`replace_atomically` says so when it happens before it
returns).  :func:`warn_if_shared` warns about such a folder.

Shared by both sides (the rank side's checkpoints, the engine's logs, exports, run files and reservations);
standard library only.
"""
from __future__ import annotations

import contextlib
import errno
import grp
import os
import shutil
import socket
import stat
import tempfile
import warnings
from typing import BinaryIO, Callable, Iterator

# Never follow a link at the last component, never wait on a FIFO or a device, never hand the descriptor to a child.
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS
DEFAULT_MODE = 0o600
_WRITING = os.O_WRONLY | os.O_RDWR


class NotOwnFileError(PermissionError):
    """A name is not a regular file of this user's (a link, a FIFO, a folder, another user's file) and was not
    opened; the message names it, what it is and whose."""


class SharedFolderWarning(UserWarning):
    """Other users may write in a folder ddp_notebook writes files into."""


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
    """A descriptor of the folder ``name`` (in the folder ``dir_fd``, else from here), never through a link:
    files opened relative to it are in the folder that was checked, whatever is put at its path afterwards.
    Raises :class:`NotOwnFileError` naming what is there when it is a link or not a folder, FileNotFoundError
    when nothing is."""
    try:
        return os.open(name, FOLDER_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.lstat(name, dir_fd=dir_fd)
        raise NotOwnFileError(f"{name} is {describe(st)}, not a folder") from None


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


def open_own_file(name: str, flags: int, mode: int = DEFAULT_MODE, *, dir_fd: int | None = None,
                  shown: str | None = None) -> int:
    """A descriptor of ``name`` (in the folder ``dir_fd``, else from here), opened with ``flags`` (``os.O_RDONLY``,
    ``os.O_WRONLY | os.O_APPEND | os.O_CREAT``...) only when it is a regular file of this user's; one opened for
    writing also has no other name (a hard link to a file elsewhere), and is truncated (``O_TRUNC``) only once that
    is known.  A file it makes gets ``mode`` (0600), not changed by the umask; an existing file keeps its own.
    Raises :class:`NotOwnFileError` naming ``shown`` (the path as the user knows it; ``name`` by default) when
    something else is there, FileNotFoundError when nothing is and ``flags`` do not create."""
    shown = shown or name
    truncate = flags & os.O_TRUNC
    flags &= ~os.O_TRUNC
    made = False
    try:
        if not flags & os.O_CREAT:
            fd = os.open(name, flags | OPEN_FLAGS, dir_fd=dir_fd)
        else:
            while True:
                try:
                    fd = os.open(name, flags | os.O_EXCL | OPEN_FLAGS, 0o600, dir_fd=dir_fd)
                    made = True
                    break
                except FileExistsError:
                    if flags & os.O_EXCL:
                        raise
                try:
                    fd = os.open(name, flags & ~os.O_CREAT | OPEN_FLAGS, dir_fd=dir_fd)
                    break
                except FileNotFoundError:
                    continue  # removed between the two: made now
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as exc:  # ELOOP: a link; ENXIO: a FIFO no one reads, a socket; EACCES: another user's file
        raise _not_own(name, dir_fd, shown, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not is_ours(st):
            raise NotOwnFileError(f"{shown} is {describe(st)}, not a plain file of yours: not opened")
        if flags & _WRITING and st.st_nlink != 1:
            raise NotOwnFileError(f"{shown} is a file of yours with {st.st_nlink - 1} other name(s) "
                                  f"(a hard link, maybe to a file elsewhere): not opened")
        if made and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)  # made just now: the umask does not change it
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_own(name: str, dir_fd: int | None, shown: str, exc: OSError) -> OSError:
    """What to raise for ``exc``, an open of ``name`` that failed: :class:`NotOwnFileError` naming what is there."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return exc
    if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EACCES, errno.EPERM, errno.EISDIR) or not is_ours(st):
        return NotOwnFileError(f"{shown} is {describe(st)}, not a plain file of yours: not opened")
    return exc


def others_who_may_write(st: os.stat_result) -> str | None:
    """Who besides this user may add, remove or replace files in the folder ``st`` is of: 'every user', 'its
    group', 'its owner alice'; None when no one may.  A group of the owner alone (a user private group) is no other
    user, and neither is root."""
    mode = st.st_mode
    if mode & stat.S_IWOTH:
        return "every user"
    if mode & stat.S_IWGRP:
        owner = user_name(st.st_uid)
        try:
            group = grp.getgrgid(st.st_gid)
            own_group = group.gr_name == owner and set(group.gr_mem) <= {owner}
        except KeyError:
            own_group = False
        if not own_group:
            return "its group"
    if not is_ours(st) and st.st_uid != 0 and mode & stat.S_IWUSR:
        return f"its owner {user_name(st.st_uid)}"
    return None


def warn_if_shared(folder: str | int, shown: str, risk: str, advice: str,
                   category: type[Warning] = SharedFolderWarning, stacklevel: int = 2) -> bool:
    """Warn (``category``) when other users may write in ``folder`` (a path or an open descriptor; ``shown`` is
    how the message names it): '{who} may write in {shown} (mode M): {risk}; {advice}'.  True when it warned."""
    st = os.stat(folder)
    who = others_who_may_write(st)
    if who is not None:
        warnings.warn(f"ddp_notebook: {who} may write in {shown} (mode {stat.S_IMODE(st.st_mode):o}): {risk}; "
                      f"{advice}", category, stacklevel=stacklevel + 1)
    return who is not None
