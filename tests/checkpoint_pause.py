"""Fault injection for the checkpoint tests, kept out of the package: a save that stops once its new data is whole on
disk and before it becomes the current checkpoint, for the test to kill the process there.

``pause_before_rename(path, signal_file)``, called in the process that saves (a rank, a script), wraps
``safe_files.replace_atomically`` there: the write that would make ``path`` current (the checkpoint file's rename; for
a sharded checkpoint, its index's) first writes ``signal_file`` with ``{"pid", "path", "temp", "size"}`` ("temp": the
new file, or the new save's folder), then waits until the test kills the process or removes ``signal_file`` (at most
120 s).
"""
from __future__ import annotations

import json
import os
import time

from ddp_notebook.rank import checkpoint
from ddp_notebook.wire import safe_files


def pause_before_rename(path, signal_file) -> None:
    checkpoint_file = os.path.abspath(path)
    sharded_index = os.path.join(checkpoint_file, checkpoint.SHARDED_INDEX)
    replace_atomically = safe_files.replace_atomically

    def paused(target, mode=safe_files.DEFAULT_MODE, before_rename=None):
        where = os.path.abspath(target)
        if where == checkpoint_file:
            return replace_atomically(target, mode, lambda temp: _pause(temp, checkpoint_file, signal_file))
        if where == sharded_index:
            return replace_atomically(target, mode, lambda temp: _pause(_new_save(checkpoint_file, temp),
                                                                        checkpoint_file, signal_file))
        return replace_atomically(target, mode, before_rename)

    safe_files.replace_atomically = paused


def _new_save(folder: str, new_index: str) -> str:
    """The save folder the new index (written, not yet renamed into place) names: the one being committed."""
    with open(new_index) as f:
        return os.path.join(folder, json.load(f)["current"])


def _pause(temp: str, path: str, signal_file) -> None:
    note = json.dumps({"pid": os.getpid(), "temp": temp, "path": path, "size": os.path.getsize(temp)})
    with open(f"{signal_file}.part", "w") as f:
        f.write(note)
    os.replace(f"{signal_file}.part", signal_file)
    deadline = time.monotonic() + 120
    while os.path.exists(signal_file) and time.monotonic() < deadline:
        time.sleep(0.02)  # the test kills this process here, or removes the file to let the rename happen
