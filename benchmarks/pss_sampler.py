"""Peak total PSS of a process and all its descendants, sampled every 20 ms from a separate process.

``python benchmarks/pss_sampler.py ROOT_PID OUT.json``: runs until ROOT_PID is gone (or a zombie).  An
in-process sampler would miss short peaks and count itself; this one reads /proc/PID/smaps_rollup.
"""
from __future__ import annotations

import json
import os
import sys
import time

INTERVAL_S = 0.020
_FIELDS = {"Pss:": "pss", "Pss_Anon:": "anon", "Pss_File:": "file", "Pss_Shmem:": "shmem"}


def rollup(pid: int) -> dict | None:
    """Pss and its split (anonymous, file, shmem) in bytes; None when gone or a zombie."""
    found = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = _FIELDS.get(line.split(None, 1)[0])
                if key:
                    found[key] = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return found if "pss" in found else None


def descendants(pid: int) -> list[int]:
    """Children of every thread, recursively, from /proc (much cheaper than scanning all processes)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[-50:]
    except OSError:
        return "?"


def main(root_pid: int, out: str) -> None:
    peak, at_peak, samples, started = 0, {}, 0, time.perf_counter()
    while True:
        tick = time.perf_counter()
        root = rollup(root_pid)
        if root is None:
            break  # the run is over
        parts = {root_pid: root}
        for pid in descendants(root_pid):
            found = rollup(pid)
            if found is not None:
                parts[pid] = found
        total = sum(p["pss"] for p in parts.values())
        samples += 1
        if total > peak:
            peak, at_peak = total, parts
        time.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - tick)))
    elapsed = time.perf_counter() - started
    processes = [{"pid": pid, "cmd": _name(pid), **{k: v / 2**20 for k, v in p.items()}} for pid, p in at_peak.items()]
    with open(out, "w") as f:
        json.dump({"peak_bytes": peak, "peak_processes": processes, "samples": samples,
                   "mean_interval_s": elapsed / max(samples, 1)}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
