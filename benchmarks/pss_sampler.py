"""Peak total PSS of a process and all its descendants, sampled every 20 ms from a separate process.

``python benchmarks/pss_sampler.py ROOT_PID OUT.json``: runs until ROOT_PID is gone (or a zombie).  An
in-process sampler would miss short peaks and count itself; this one reads /proc/PID/smaps_rollup.
A child started with vfork shares its parent's address space until it execs; its smaps_rollup then
repeats the parent's, so it is left out (kcmp) rather than counted twice.
"""
from __future__ import annotations

import ctypes
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


_KCMP = {"x86_64": 312, "aarch64": 272}.get(os.uname().machine)
_libc = ctypes.CDLL(None, use_errno=True)


def same_memory(pid: int, other: int) -> bool:
    """Do two processes share one address space?  A vfork child does until it execs: count it once."""
    if _KCMP is None:
        return False
    return _libc.syscall(_KCMP, pid, other, 1, 0, 0) == 0  # KCMP_VM


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
            for kid in kids:
                if not same_memory(kid, parent):  # (its memory is its parent's, counted there)
                    found.append(kid)
                todo.append(kid)
    return found


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[-50:]
    except OSError:
        return "?"


def main(root_pid: int, out: str) -> None:
    peak, at_peak, samples, started = 0, {}, 0, time.perf_counter()
    names = {}
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
                if pid not in names:
                    names[pid] = _name(pid)
        total = sum(p["pss"] for p in parts.values())
        samples += 1
        if total > peak:
            peak, at_peak = total, parts
        time.sleep(max(0.0, INTERVAL_S - (time.perf_counter() - tick)))
    elapsed = time.perf_counter() - started
    names[root_pid] = "notebook"
    processes = [{"pid": pid, "cmd": names.get(pid, "?"), **{k: v / 2**20 for k, v in p.items()}}
                 for pid, p in at_peak.items()]
    with open(out, "w") as f:
        json.dump({"peak_bytes": peak, "peak_processes": processes, "samples": samples,
                   "mean_interval_s": elapsed / max(samples, 1)}, f)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
