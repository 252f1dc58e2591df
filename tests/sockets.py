"""What a process leaves in the kernel's socket table, not only in its fd table.

A listening socket whose fd was closed while a thread sat in ``accept()`` on it
keeps listening with no fd anywhere: only ``/proc/net/tcp{,6}`` shows it.
"""
from __future__ import annotations

import os
import time

import psutil

_LISTEN = "0A"


def listeners() -> dict[tuple[str, int], int]:
    """Every TCP listening socket of this network namespace: (hex address, port) -> inode."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            if fields[3] == _LISTEN:
                address, port = fields[1].rsplit(":", 1)
                found[(address, int(port, 16))] = int(fields[9])
    return found


def held_elsewhere(inodes: set[int], root: int) -> set[int]:
    """The inodes among these that a live process outside ``root``'s tree holds an fd of (another program's)."""
    ours = {root} | {p.pid for p in _children(root)}
    held = set()
    for pid in psutil.pids():
        if pid in ours:
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and int(link[8:-1]) in inodes:
                    held.add(int(link[8:-1]))
        except OSError:
            continue
    return held


def _children(pid: int) -> list:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def new_listeners(before: dict[tuple[str, int], int], root: int | None = None) -> set[tuple[str, int]]:
    """Listeners that appeared since ``before`` and are not another program's: ours, or held by no fd at all.  One
    that another program (another pytest worker's kernel or ranks) closed while the fds were read looked held by
    none: it is gone from the table read again after."""
    now = listeners()
    new = {key: inode for key, inode in now.items() if before.get(key) != inode}
    foreign = held_elsewhere(set(new.values()), root or os.getpid())
    still = listeners()
    return {key for key, inode in new.items() if inode not in foreign and still.get(key) == inode}


def accepted(server, timeout: float = 30.0):
    """The first connection a channel server accepts (it has passed the handshake), within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conns = server.new_connections()
        if conns:
            return conns[0]
        time.sleep(0.01)
    raise AssertionError("the server accepted no connection")
