"""Reading the files of a run whose ranks report without a notebook: ``metrics-node<I>.jsonl`` and results.

The rank side writes them (``rank/torchrun.py``: one JSON-lines file per node,
whole lines only, a new file per run); :func:`ddp_notebook.follow` and a Slurm
job whose ranks cannot reach the notebook (``engine/slurm.py``) read them here,
a few times a second, as they grow.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import pwd
import stat

from ..wire import protocol
from ..wire.protocol import METRICS_PREFIX, METRICS_SUFFIX

REPORT_KEYS = ("key", "x", "values", "total", "n", "sum", "epoch")
FAILURE_KEYS = ("etype", "message", "traceback", "time", "kind")


class Tail:
    """The new whole lines of one file; starts over when the file is replaced (a new run)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.inode: int | None = None

    def read(self) -> list[bytes]:
        try:
            f = open(self.path, "rb")  # opened afresh each time: other hosts' writes show (close-to-open)
        except FileNotFoundError:
            return []
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino != self.inode or st.st_size < self.offset:
                self.inode, self.offset = st.st_ino, 0
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        return data[:end].splitlines()


class RunFiles:
    """The records the nodes of runs in ``run_dir`` have appended since the last call (every run's).

    With ``key`` (a Slurm job's: the notebook's channel key), the folder is read only while it is a folder of this
    user's that no other user may write in, a record counts only when signed with the key
    (:func:`~ddp_notebook.wire.protocol.verified_record`), and a result only when its file is the one its record
    names (SHA-256): nothing anyone else wrote is believed or unpickled.  ``problems``: what was refused, once each.
    """

    def __init__(self, run_dir: str, key: bytes | None = None):
        self.run_dir = run_dir
        self.key = key
        self.problems: list[str] = []
        self._tails: dict[str, Tail] = {}

    def _refuse(self, problem: str) -> None:
        if problem not in self.problems:
            self.problems.append(problem)

    def _trusted(self) -> bool:
        try:
            problem = folder_problem(self.run_dir)
        except FileNotFoundError:
            return False
        if problem is not None:
            self._refuse(f"{problem}: its files are not read")
        return problem is None

    def new_records(self) -> list[dict]:
        if self.key is not None and not self._trusted():
            return []
        pattern = os.path.join(glob.escape(self.run_dir), f"{METRICS_PREFIX}*{METRICS_SUFFIX}")
        for path in sorted(glob.glob(pattern)):
            self._tails.setdefault(path, Tail(path))
        records = []
        for tail in self._tails.values():
            forged = 0
            for raw in tail.read():
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
        path = os.path.join(self.run_dir, os.path.basename(record["file"]))
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            self._refuse(f"the result file {path} cannot be read: {exc.strerror}")
            return None
        with os.fdopen(fd, "rb") as f:
            data = f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else b""
        if self.key is not None and hashlib.sha256(data).hexdigest() != record.get("sha256"):
            self._refuse(f"the result file {path} is not the one its record names: not unpickled")
            return None
        return data


def folder_problem(run_dir: str) -> str | None:
    """Why the files in ``run_dir`` cannot be believed: it is not a folder, another user owns it, or other users may
    write in it; None when it is a folder of this user's that no one else may write in.  Raises FileNotFoundError
    when it is not there."""
    st = os.lstat(run_dir)
    if not stat.S_ISDIR(st.st_mode):
        return f"{run_dir} is not a folder"
    if st.st_uid != os.geteuid():
        return f"{run_dir} belongs to {_user(st.st_uid)}, not to you"
    if st.st_mode & 0o022:
        return f"other users may write in {run_dir} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


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
