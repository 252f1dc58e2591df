"""Reading the files of a run whose ranks report without a notebook: ``metrics-node<I>.jsonl`` and results.

The rank side writes them (``rank/torchrun.py``: one JSON-lines file per node,
whole lines only, a new file per run); :func:`ddp_notebook.follow` and a Slurm
job whose ranks cannot reach the notebook (``engine/slurm.py``) read them here,
a few times a second, as they grow.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import weakref

from ..wire import safe_files, protocol
from ..wire.protocol import METRICS_PREFIX, METRICS_SUFFIX

REPORT_KEYS = ("key", "x", "values", "total", "n", "sum", "epoch")
FAILURE_KEYS = ("etype", "message", "traceback", "time", "kind")


class UntrustedRunFolder(PermissionError):
    """The files of a run folder cannot be believed (:func:`folder_problem`); the message says why."""


class Tail:
    """The new whole lines of the file ``name`` in an open run folder; starts over when the file is replaced (a new
    run).  ``path`` names it in messages."""

    def __init__(self, name: str, path: str):
        self.name = name
        self.path = path
        self.offset = 0
        self.inode: int | None = None

    def read(self, folder_fd: int) -> list[bytes]:
        """Raises NotOwnFileError when the file is not a plain file of this user's (a link, a FIFO)."""
        try:  # opened afresh each time: other hosts' writes show (close-to-open)
            fd = safe_files.open_own_file(self.name, os.O_RDONLY, dir_fd=folder_fd, shown=self.path)
        except FileNotFoundError:
            return []
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if st.st_ino != self.inode or st.st_size < self.offset:
                self.inode, self.offset = st.st_ino, 0
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].splitlines()


class RunFiles:
    """The records the nodes of runs in ``run_dir`` have appended since the last call (every run's).

    The folder is opened once, when it is first there, never through a link, and every file is read through that
    descriptor (:mod:`~ddp_notebook.wire.safe_files`): whatever is put at its path later, only the folder checked
    is read, and in it only plain files of this user's (a link or a FIFO is refused, once each, in ``problems``).
    The folder is read only while it is a folder of this user's that no other user may write in
    (:meth:`folder`).  With ``key`` (a Slurm job's: the notebook's channel key), a record counts only when signed
    with the key (:func:`~ddp_notebook.wire.protocol.verified_record`), and a result only when its file is the one
    its record names (SHA-256): nothing anyone else wrote is believed or unpickled.  ``problems``: what was
    refused, once each.  :meth:`close` lets go of the folder (so does the garbage collector).
    """

    def __init__(self, run_dir: str, key: bytes | None = None):
        self.run_dir = run_dir
        self.key = key
        self.problems: list[str] = []
        self._tails: dict[str, Tail] = {}
        self._fd: int | None = None
        self._closer: weakref.finalize | None = None

    def _refuse(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def folder(self) -> int | None:
        """The run folder's descriptor, opened the first time it is there; None while it is not.  Raises
        :class:`UntrustedRunFolder` saying why when it is not a folder of this user's that only they may write in
        (checked on every call: its mode may change)."""
        if self._fd is None:
            try:
                fd = safe_files.open_folder(self.run_dir)
            except FileNotFoundError:
                return None
            except safe_files.NotOwnFileError as exc:
                raise UntrustedRunFolder(str(exc)) from None
            self._fd, self._closer = fd, weakref.finalize(self, os.close, fd)
        problem = folder_problem(os.fstat(self._fd), self.run_dir)
        if problem is not None:
            raise UntrustedRunFolder(problem)
        return self._fd

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self._fd = None
        self._closer = None

    def _open_folder(self) -> int | None:
        """:meth:`folder`; for a Slurm job's files (``key``), a problem said rather than raised."""
        if self.key is None:
            return self.folder()
        try:
            return self.folder()
        except UntrustedRunFolder as exc:
            self._refuse(f"{exc}: its files are not read")
            return None

    def new_records(self) -> list[dict]:
        """The new records; raises :class:`UntrustedRunFolder` (without ``key``) for a folder not to be read."""
        fd = self._open_folder()
        if fd is None:
            return []
        for name in sorted(os.listdir(fd)):
            if name.startswith(METRICS_PREFIX) and name.endswith(METRICS_SUFFIX) and name not in self._tails:
                self._tails[name] = Tail(name, os.path.join(self.run_dir, name))
        records = []
        for tail in self._tails.values():
            forged = 0
            try:
                lines = tail.read(fd)
            except safe_files.NotOwnFileError as exc:
                self._refuse(str(exc))
                continue
            for raw in lines:
                try:
                    record = json.loads(raw)
                except ValueError:
                    continue  # not a line of ours
                if self.key is not None:
                    record = protocol.verified_record(record, self.key) if isinstance(record, dict) else None
                    if record is None:
                        forged += 1
                        continue
                records.append(record)
            if forged:
                self._refuse(f"records in {tail.path} not signed with this job's key were ignored")
        return records

    def result(self, record: dict) -> bytes | None:
        """The pickled return value a ``FILE_RESULT`` record points to; None (with a problem) when its file is not
        the one the record names."""
        name = os.path.basename(record["file"])
        path = os.path.join(self.run_dir, name)
        fd = self._open_folder()
        if fd is None:
            self._refuse(f"the result file {path} cannot be read: its folder is not there")
            return None
        try:
            result_fd = safe_files.open_own_file(name, os.O_RDONLY, dir_fd=fd, shown=path)
        except safe_files.NotOwnFileError as exc:
            self._refuse(f"the result file {exc}")
            return None
        except OSError as exc:
            self._refuse(f"the result file {path} cannot be read: {exc.strerror}")
            return None
        with os.fdopen(result_fd, "rb") as f:
            data = f.read()
        if self.key is not None and hashlib.sha256(data).hexdigest() != record.get("sha256"):
            self._refuse(f"the result file {path} is not the one its record names: not unpickled")
            return None
        return data


def folder_problem(st: os.stat_result, run_dir: str) -> str | None:
    """Why the files in the folder ``run_dir`` (``st``: its ``stat``) cannot be believed: another user owns it, or
    other users may write in it; None when it is a folder of this user's that no one else may write in."""
    if not stat.S_ISDIR(st.st_mode):
        return f"{run_dir} is not a folder"
    if not safe_files.is_ours(st):
        return f"{run_dir} belongs to {safe_files.user_name(st.st_uid)}, not to you"
    if st.st_mode & 0o022:
        return f"other users may write in {run_dir} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def message_of(record: dict) -> tuple[str, int, dict] | None:
    """The channel message a record stands for (READY, METRIC, PROGRESS, FAILED), as ``(kind, rank, body)``;
    None for the records only files have (start, exit, end, result)."""
    event, rank = record.get("event"), record.get("rank", -1)
    if event == protocol.READY:
        return protocol.READY, rank, {}
    if event == protocol.METRIC:
        return protocol.METRIC, rank, {"reports": [{k: record[k] for k in REPORT_KEYS if k in record}]}
    if event == protocol.PROGRESS:
        return protocol.PROGRESS, rank, {"done": record["done"], "total": record["total"]}
    if event == protocol.FAILED:
        return protocol.FAILED, rank, {k: record[k] for k in FAILURE_KEYS}
    return None
