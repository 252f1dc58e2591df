"""Files of this user's opened in folders other users may write in (a group project folder: 0777 or
group-writable, often not sticky), and how such a folder is told apart.

A name in such a folder may be anything another user put there first: a symbolic link to a private file of
yours (written through, it would get what was meant for the log), a FIFO (opened, it would wait forever), a hard
link, a file of theirs.  :func:`open_own_file` opens a name only when it is a regular file of this user's, with
no other name: never through a link, never waiting on a FIFO, made 0600 when it is new; anything else is
refused with :class:`NotOwnFileError`, which says what is there and whose it is.  :func:`open_folder` opens a
folder once, never through a link, so that every file read from it is in the folder that was checked.

What another user who may write in the folder can still do, and nothing here prevents: remove or rename the
files in it (in a folder that is not sticky), and put their own at the name before it is made or after it was
removed (refused then, not followed).  :func:`warn_if_shared` warns about such a folder.

Shared by both sides; standard library only.
"""
from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
import warnings

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


def user_name(uid: int) -> str:
    """The login name of ``uid``, or ``uid N`` when it has none."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def is_ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def describe(st: os.stat_result) -> str:
    """What a ``stat`` result is, and whose: 'a symbolic link of alice's'."""
    kind = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder", stat.S_IFIFO: "a FIFO",
            stat.S_IFSOCK: "a socket", stat.S_IFREG: "a file"}.get(stat.S_IFMT(st.st_mode), "a device")
    return f"{kind} of yours" if is_ours(st) else f"{kind} of {user_name(st.st_uid)}'s"


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
