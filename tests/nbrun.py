"""Run notebook cells in a real Jupyter kernel (nbclient) and read their outputs."""
from __future__ import annotations

import contextlib
import re
import time

import nbformat
import psutil
from jupyter_client.manager import start_new_kernel
from nbclient import NotebookClient


def run_cells(cells: list[str], timeout: int = 120, cwd: str | None = None, allow_errors: bool = True):
    """Execute the cells in a fresh python3 kernel; returns (notebook, client)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            resources={"metadata": {"path": cwd}} if cwd else {})
    client.execute()
    return nb, client


@contextlib.contextmanager
def kernel(setup: str = "%load_ext ddp_notebook"):
    """A fresh python3 kernel, ``setup`` run in it; yields (manager, client) and shuts it down afterwards."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        if setup:
            kc.execute_interactive(setup, timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def execute(kc, cells: list[str], timeout: int = 180) -> str:
    """Run ``cells`` one after the other on a kernel client; what they printed and their tracebacks, as text."""
    outputs = []

    def collect(msg):
        if msg["msg_type"] == "stream":
            outputs.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            outputs.append("\n".join(msg["content"]["traceback"]))

    for cell in cells:
        kc.execute_interactive(cell, timeout=timeout, output_hook=collect)
    return "".join(outputs)


def text(cell) -> str:
    """Everything a cell printed (streams) plus error tracebacks, as plain text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
            parts.append(f"\n{out.ename}: {out.evalue}\n")
    return "".join(parts)


def error(cell):
    """The cell's error output, or None."""
    for out in cell.outputs:
        if out.output_type == "error":
            return out
    return None


def run_until_pids(kc, code, n=2, timeout=60):
    """Execute code in a kernel client until the ranks have printed `PID <pid>`; (msg_id, pids)."""
    msg_id = kc.execute(code)
    pids, deadline = set(), time.time() + timeout
    while len(pids) < n and time.time() < deadline:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            pids.update(int(p) for p in re.findall(r"PID (\d+)", msg["content"]["text"]))
    assert len(pids) == n
    return msg_id, pids


def gone(pids, within):
    """True once none of the pids is alive (zombies count as gone: they hold nothing)."""
    deadline = time.time() + within
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return True
        time.sleep(0.05)
    return False
