"""Reading the files of a run whose ranks report without a notebook: ``metrics-node<I>.jsonl`` and results.

The rank side writes them (``rank/torchrun.py``: one JSON-lines file per node,
whole lines only, a new file per run); :func:`ddp_notebook.follow` and a Slurm
job whose ranks cannot reach the notebook (``engine/slurm.py``) read them here,
a few times a second, as they grow.
"""
from __future__ import annotations

import glob
import json
import os

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
    """The records the nodes of runs in ``run_dir`` have appended since the last call (every run's)."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self._tails: dict[str, Tail] = {}

    def new_records(self) -> list[dict]:
        pattern = os.path.join(glob.escape(self.run_dir), f"{METRICS_PREFIX}*{METRICS_SUFFIX}")
        for path in sorted(glob.glob(pattern)):
            self._tails.setdefault(path, Tail(path))
        records = []
        for tail in self._tails.values():
            for raw in tail.read():
                try:
                    records.append(json.loads(raw))
                except ValueError:
                    continue  # not a line of ours
        return records

    def result(self, record: dict) -> bytes:
        """The pickled return value a ``FILE_RESULT`` record points to."""
        with open(os.path.join(self.run_dir, os.path.basename(record["file"])), "rb") as f:
            return f.read()


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
