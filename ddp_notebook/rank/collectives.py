"""The collectives a rank has called, read from torch's Flight Recorder on request (``job.why()``).

A rank blocked in a collective is stuck in C++ on its main thread, so the record is read on a thread of its own.
A rank of the notebook's host waits on a FIFO in the job's directory; each byte the notebook writes there makes
it write the Flight Recorder's entries (name, sequence number, sizes, completed or not, when made) as JSON beside
it.  A rank that runs an export (a Slurm task, a rank of another host) shares no folder with the notebook: the
thread that reads its channel answers ``WHERE`` with :func:`here` instead.  The Flight Recorder keeps entries when
``TORCH_FR_BUFFER_SIZE`` is set as the process group is made (the rank's environment sets it:
``engine.backend.rank_environment``; an export's script sets it before torch loads).
"""
from __future__ import annotations

import faulthandler
import json
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback

from ..wire import protocol

_KEPT = 64  # the newest entries of each process group: the ones a hang is about


def entries() -> list[dict]:
    """The Flight Recorder's newest entries: ``{"group", "seq", "name", "sizes", "done", "created"}`` each."""
    import torch

    c10d = torch._C._distributed_c10d
    if hasattr(c10d, "_dump_fr_trace_json"):  # without the Python stacks, whose symbols take seconds at first
        record = json.loads(c10d._dump_fr_trace_json(True, False))
    elif hasattr(c10d, "_dump_fr_trace"):
        record = pickle.loads(c10d._dump_fr_trace())
    else:
        return []
    found = []
    for entry in record.get("entries", [])[-_KEPT * 4:]:
        if entry.get("is_p2p"):
            continue
        found.append({
            "group": str(entry.get("process_group", ("0",))[0]),
            "seq": int(entry.get("collective_seq_id", 0)),
            "name": str(entry.get("profiling_name", "?")).split(":")[-1],
            "sizes": entry.get("input_sizes") or [],
            "done": bool(entry.get("retired")) or entry.get("state") == "completed",
            "created": (entry.get("time_created_ns") or 0) / 1e9,
        })
    return found[-_KEPT:]


def here(request: dict) -> dict:
    """The answer to the notebook's ``WHERE``: this rank's collectives and every thread's Python stack, as asked
    (faulthandler's text, which the notebook reads as it reads a dump on SIGUSR1)."""
    answer: dict = {"time": time.time()}
    try:
        if request.get("collectives"):
            answer["collectives"] = entries()
        if request.get("stack"):
            with tempfile.TemporaryFile("w+") as dump:  # (faulthandler writes to a descriptor)
                faulthandler.dump_traceback(dump, all_threads=True)
                dump.seek(0)
                answer["stack"] = dump.read()
    except Exception as exc:  # noqa: BLE001 - said in the diagnosis instead
        answer["error"] = f"{type(exc).__name__}: {exc}"
    return answer


def _main_thread_at() -> list[tuple]:
    """Where the main thread is (file, line and function of each frame): what changes when the task moves on,
    unlike the other threads' stacks (the run files' writer, the sender)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return [(f.f_code.co_filename, f.f_lineno, f.f_code.co_name) for f, _ in traceback.walk_stack(frame)] \
        if frame is not None else []


def tell_when_still(send, still_after: float, done: threading.Event) -> threading.Thread:
    """Where no one can ask (an export that reports through its run files, followed with ``follow()``): each time
    this rank's collectives have not moved for ``still_after`` seconds, ``send`` its :func:`here` as a ``HERE``
    event, once for each new state (its collectives or its main thread's place changed since the last one sent);
    until ``done`` is set."""

    def watch() -> None:
        seen = told = None
        while not done.wait(still_after):
            try:
                found = entries()
            except Exception:  # noqa: BLE001 - no Flight Recorder: nothing to tell
                return
            state = [(e["group"], e["seq"], e["done"]) for e in found[-4:]]
            if state != seen:
                seen = state  # it moves
                continue
            where = _main_thread_at()
            if (found, where) == told:
                continue
            told = found, where
            answer = here({"collectives": True, "stack": True})
            try:
                send(protocol.HERE, answer)
            except Exception:  # noqa: BLE001 - the task has ended and its way to the files with it
                return

    thread = threading.Thread(target=watch, name="ddp-tell-when-still", daemon=True)
    thread.start()
    return thread


def _write(job_dir: str, rank: int) -> None:
    try:
        body = {"rank": rank, "entries": entries(), "time": time.time()}
    except Exception as exc:  # noqa: BLE001 - said in the diagnosis instead
        body = {"rank": rank, "entries": [], "error": f"{type(exc).__name__}: {exc}", "time": time.time()}
    path = protocol.collectives_path(job_dir, rank)
    temp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        json.dump(body, handle)
    os.replace(temp, path)  # the notebook never reads half a file


def _serve(job_dir: str, rank: int, fifo: str) -> None:
    while True:
        try:
            fd = os.open(fifo, os.O_RDONLY)  # waits for the notebook to open it for writing
        except OSError:
            return
        try:
            while os.read(fd, 64):
                pass
        finally:
            os.close(fd)
        _write(job_dir, rank)


def install(job_dir: str, rank: int) -> None:
    """Answer the notebook's requests for this rank's collectives, on a thread of their own."""
    fifo = protocol.collectives_request_path(job_dir, rank)
    try:
        if os.path.exists(fifo):
            os.unlink(fifo)  # a warm pool's earlier rank of the same number
        os.mkfifo(fifo, 0o600)
    except OSError:
        return
    threading.Thread(target=_serve, args=(job_dir, rank, fifo), name="ddp-collectives", daemon=True).start()
