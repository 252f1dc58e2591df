"""Run notebook cells in a real Jupyter kernel (nbclient) and read their outputs."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
from jupyter_client.manager import KernelManager

# nbformat and nbclient are imported where they are used: ranks import a test module to run its functions, and with
# it this one, where they would add seconds (jsonschema's checkers) to every rank's start.


def kernel_manager() -> KernelManager:
    """A manager of a python3 kernel on IPC sockets in this worker's temp folder.  Over TCP (jupyter_client's
    default) the client picks free ports and the kernel binds them a second later: any process may take one meanwhile,
    and the kernel dies before replying ("Address already in use"; seen in a full run of the suite)."""
    folder = os.path.join(tempfile.gettempdir(), "kernel-sockets")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(folder, uuid.uuid4().hex[:12]))


def start_kernel(env: dict | None = None, startup_timeout: float = 60):
    """jupyter_client's ``start_new_kernel`` on IPC sockets (:func:`kernel_manager`): (manager, client)."""
    km = kernel_manager()
    km.start_kernel(**({"env": env} if env else {}))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=startup_timeout)
    except RuntimeError:
        kc.stop_channels()
        km.shutdown_kernel()
        raise
    return km, kc


def run_cells(cells: list[str], timeout: int = 120, cwd: str | None = None, allow_errors: bool = True):
    """Execute the cells in a fresh python3 kernel; returns (notebook, client)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, km=kernel_manager(), timeout=timeout, kernel_name="python3",
                            allow_errors=allow_errors, resources={"metadata": {"path": cwd}} if cwd else {})
    client.execute()
    return nb, client


# The kernels the tests of where output lands run on: ipykernel 7 (this environment's) and 6, which routes output
# from threads to cells differently.  ipykernel 6 is pip-installed once into a folder put first on the kernel's
# PYTHONPATH; everything else is this environment's.
IPYKERNEL_6 = "ipykernel>=6.29,<7"
IPYKERNEL_VERSIONS = [7, 6]


def ipykernel6_path() -> str:
    """A folder holding ipykernel 6 (installed there on first use); skips (fails under CI=true) without pip."""
    import fcntl

    import pytest

    folder = os.path.join(os.path.expanduser("~"), ".cache", "ddp_notebook-tests", "ipykernel6")
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (pytest-xdist workers: one installs, the others wait for it)
        if not os.path.exists(os.path.join(folder, "ipykernel", "__init__.py")):
            done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--target", folder, "--no-deps",
                                   IPYKERNEL_6, "nest_asyncio"], capture_output=True, text=True)
            if done.returncode != 0:
                why = f"cannot install {IPYKERNEL_6} for the ipykernel 6 runs: {done.stderr.strip()[-500:]}"
                if os.environ.get("CI") == "true":
                    pytest.fail(why)
                pytest.skip(why)
    return folder


@contextlib.contextmanager
def kernel(setup: str = "%load_ext ddp_notebook", ipykernel: int = 7):
    """A fresh python3 kernel, ``setup`` run in it; yields (manager, client) and shuts it down afterwards.
    ``ipykernel=6`` runs it on ipykernel 6 instead of this environment's 7."""
    env = None
    if ipykernel == 6:
        path = [ipykernel6_path()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    km, kc = start_kernel(env)
    try:
        got = kc.execute_interactive("import ipykernel; assert ipykernel.version_info[0] == %d, ipykernel.__version__"
                                     % ipykernel, timeout=60, output_hook=lambda msg: None, store_history=False)
        assert got["content"]["status"] == "ok", got["content"]
        if setup:
            kc.execute_interactive(setup, timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


class SharedKernel:
    """One kernel that the tests of a module take in turn (:meth:`take`), instead of a fresh one each: a kernel's
    start, its ``import torch`` and its rank template cost about 5 CPU-seconds and 3 s.

    A test takes it as it was left by the one before: idle (a cell is run first, so a cell still running or an
    interrupt still arriving has ended), with the same namespace and ddp_notebook state.  A test that fails, or
    leaves the kernel dead, is the last to use it: the next test gets a fresh one.  Tests that need a kernel that
    never ran a job (the template's first start, the kernel's own memory or descriptors) keep :func:`kernel`."""

    def __init__(self, setup: str = "%load_ext ddp_notebook", ipykernel: int = 7):
        self.setup, self.ipykernel = setup, ipykernel
        self._stack: contextlib.ExitStack | None = None
        self._pair = None

    @contextlib.contextmanager
    def take(self):
        """(manager, client) of the module's kernel for one test, started if there is none or it died."""
        if self._pair is not None and not self._ready():
            self.close()
        if self._pair is None:
            self._stack = contextlib.ExitStack()
            self._pair = self._stack.enter_context(kernel(self.setup, self.ipykernel))
        try:
            yield self._pair
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        """Alive, idle and clean: no rank of this run is left (a test that failed after its ``with`` block, or in
        ``no_leftovers``, may have left a job running), a cell runs to its end (after whatever the last test left
        running or interrupted), and the messages the last test left unread are dropped (for at most 5 s: a
        kernel still printing that long is not idle)."""
        import queue

        from conftest import rank_processes

        km, kc = self._pair
        if not km.is_alive() or rank_processes():
            return False
        try:
            reply = kc.execute_interactive("pass", timeout=60, output_hook=lambda msg: None, store_history=False)
        except TimeoutError:
            return False
        deadline = time.monotonic() + 5
        for get in (kc.get_iopub_msg, kc.get_shell_msg, kc.get_stdin_msg):
            while True:
                if time.monotonic() > deadline:
                    return False
                try:
                    get(timeout=0.05)
                except queue.Empty:
                    break
        return reply["content"]["status"] == "ok"

    def close(self) -> None:
        """Shut the kernel down (the module's tests are done, or the last one left it unfit)."""
        stack, self._stack, self._pair = self._stack, None, None
        if stack is not None:
            stack.close()


def _said(msg) -> str:
    """What an output message shows as text: a stream's text, an error's traceback lines ("" for anything else)."""
    if msg["msg_type"] == "stream":
        return msg["content"]["text"]
    if msg["msg_type"] == "error":
        return "\n".join(msg["content"]["traceback"])
    return ""


def execute(kc, cells: list[str], timeout: int = 180) -> str:
    """Run ``cells`` one after the other on a kernel client; what they printed and their tracebacks, as text."""
    outputs = []
    for cell in cells:
        kc.execute_interactive(cell, timeout=timeout, output_hook=lambda msg: outputs.append(_said(msg)),
                               stop_on_error=False)  # (as in run_until_pids: the next cell is not aborted)
    return "".join(outputs)


def run_cell(kc, code: str, timeout: int = 120) -> tuple[dict, str]:
    """Run one cell to its end: its reply's content, and what it printed and its traceback lines."""
    told = []
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: told.append(_said(msg)),
                                   stop_on_error=False)  # (as in run_until_pids: the next cell is not aborted)
    return reply["content"], "".join(told)


def until_idle(kc, msg_id: str, timeout: int = 60) -> tuple[dict, str]:
    """Wait for a cell started with ``kc.execute`` to end: its reply's content, and what it printed and its traceback
    lines."""
    reply = None
    while reply is None:
        msg = kc.get_shell_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") == msg_id:
            reply = msg["content"]
    told = ""
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        told += _said(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply, told


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


def run_until_pids(kc, code, n=2, timeout=60, stop_on_error=False):
    """Execute code in a kernel client until the ranks have printed `PID <pid>`; (msg_id, pids).

    The cell is sent as a lone cell, not as the first of a "Run All" (``stop_on_error=False``): a cell that ends in
    an error aborts whatever requests reach ipykernel 7 before it has posted itself the message that ends its abort
    window, and it sends the error's reply first, so a client that sends the next cell as soon as it reads that reply
    sometimes has it aborted unrun (seen in a CI run: the next cell's ranks never started).  A test of Run All's
    abort passes ``stop_on_error=True``."""
    msg_id = kc.execute(code, stop_on_error=stop_on_error)
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


def run_answering(kc, code: str, answers, timeout: int = 120, allow_stdin: bool = True):
    """Run one cell as a person at the notebook would, answering each input request (``input_request``) with the
    next of ``answers``: a line to type, or a callable (called with the prompt instead, e.g. to interrupt the
    kernel).  Returns (the reply's content, what the cell printed and its traceback lines, the prompts asked)."""
    import queue

    answers = list(answers)
    msg_id = kc.execute(code, allow_stdin=allow_stdin)
    reply, told, prompts, idle = None, [], [], False
    deadline = time.time() + timeout
    while reply is None or not idle:
        if time.time() > deadline:
            raise TimeoutError(f"the cell did not end within {timeout} s; prompts so far: {prompts}; "
                               f"printed: {''.join(told)[-2000:]}")
        try:
            msg = kc.get_stdin_msg(timeout=0.02)
        except queue.Empty:
            pass
        else:
            if msg["msg_type"] == "input_request":
                prompts.append(msg["content"]["prompt"])
                if not answers:
                    raise AssertionError(f"an unexpected prompt {prompts[-1]!r}; printed: {''.join(told)}")
                answer = answers.pop(0)
                if callable(answer):
                    answer(prompts[-1])
                else:
                    kc.input(answer)
        for get, handle in ((kc.get_iopub_msg, "iopub"), (kc.get_shell_msg, "shell")):
            while True:
                try:
                    msg = get(timeout=0.01)
                except queue.Empty:
                    break
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                if handle == "shell":
                    reply = msg["content"]
                else:
                    told.append(_said(msg))
                    idle = idle or (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle")
    return reply, "".join(told), prompts


def run_cells_answering(cells: list[str], answers: dict[int, list[str]], timeout: int = 120, cwd: str | None = None):
    """:func:`run_cells`, where the cells of ``answers`` (by index) may ask for input: the front end allows stdin
    for them and types their answers, in order, at each input request (nbclient itself never allows stdin)."""
    import asyncio

    import nbformat
    from nbclient import NotebookClient

    class AnsweringClient(NotebookClient):
        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            typed = list(answers.get(cell_index, []))
            if not typed:
                return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            self.kc.allow_stdin = True
            typing = asyncio.ensure_future(self._type(typed))
            try:
                return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            finally:
                typing.cancel()
                self.kc.allow_stdin = False

        async def _type(self, typed: list[str]) -> None:
            while typed:
                msg = await self.kc.get_stdin_msg()
                if msg["msg_type"] == "input_request":
                    self.kc.input(typed.pop(0))

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = AnsweringClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                             resources={"metadata": {"path": cwd}} if cwd else {})
    client.execute()
    return nb, client


# Kernel code: every debug message of ddp_notebook kept in DEBUG_LOG (a list), for a test to read back.
KEEP_DEBUG_LOG = """
import logging
DEBUG_LOG = []
_handler = logging.Handler(logging.DEBUG)
_handler.emit = lambda record: DEBUG_LOG.append(record.getMessage())
logging.getLogger("ddp_notebook").addHandler(_handler)
logging.getLogger("ddp_notebook").setLevel(logging.DEBUG)
"""
