"""The rank template: a process that has imported torch, from which this kernel's ranks are forked.

A cold job's ranks would each spend a second or more importing torch (and keep
their own ~240 MB copy of it); forked from the template they start at once and
share its pages.  The template (``python -m ddp_notebook.rank.template``) never
touches CUDA, so CUDA used in the kernel does not matter; each rank takes its
own session, pipes, environment, directory and ``sys.path`` of the moment it
is forked.  The template is started in the background (when the extension
loads, or at the first launch) and replaced when torch or ddp_notebook changed
on disk or it died; it goes with the kernel, with ``%ddp_stop`` and
:func:`stop`.  ``DDP_NOTEBOOK_TEMPLATE=0`` turns it off: every rank is then a
fresh ``python -m ddp_notebook.rank.worker``.
"""
from __future__ import annotations

import atexit
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time

from ..wire import forking
from ..wire.channel import ready_now

log = logging.getLogger("ddp_notebook")

READY_TIMEOUT_S = 60.0
# Variables read when an interpreter or torch starts: a rank whose value differs from the template's is started
# fresh, as the fork would not see them.
_READ_AT_START = ("LD_", "PYTHON", "MALLOC_", "MKL_", "KMP_", "GOMP_", "OMP_", "TORCH_", "DDP_NOTEBOOK_TEMPLATE")
_SET_PER_RANK = {"OMP_NUM_THREADS", "PYTHONUNBUFFERED"}

# The package's folder, from this file's place in it (importing the package root here would be an import loop).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_lock = threading.RLock()
_current: "Template | None" = None


def enabled() -> bool:
    """False when ``DDP_NOTEBOOK_TEMPLATE=0`` (or off/false/no) turns the template off."""
    return os.environ.get("DDP_NOTEBOOK_TEMPLATE", "1").strip().lower() not in ("0", "off", "false", "no")


def _code_fingerprint() -> tuple:
    """What a template's imports depend on: the interpreter, and torch's and ddp_notebook's files on disk."""
    stamps = [sys.executable]
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                stamps.append((name, st.st_mtime_ns, st.st_size))
    torch = sys.modules.get("torch")
    torch_dir = os.path.dirname(torch.__file__) if torch is not None else _find_torch()
    for name in ("__init__.py", "version.py"):
        try:
            st = os.stat(os.path.join(torch_dir or "", name))
            stamps.append((name, st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append((name, None))
    return tuple(stamps)


def _find_torch() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


def template_environment() -> dict[str, str]:
    """The template's environment: the kernel's, as a rank's starts (see ``rank_environment``)."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("MPLBACKEND", None)
    return env


def _start_time_differences(env: dict[str, str], template_env: dict[str, str]) -> list[str]:
    names = set(env) | set(template_env)
    return sorted(n for n in names if n.startswith(_READ_AT_START) and n not in _SET_PER_RANK
                  and env.get(n) != template_env.get(n))


class ForkedProcess:
    """A rank forked by the template, handled like a ``subprocess.Popen`` of this kernel.

    Its exit code comes through ``status`` (4 bytes the template writes once it
    has reaped the rank); ``lifeline`` is the pipe end whose closing ends it.
    """

    def __init__(self, pid: int, status: int, lifeline: int, stdout, stderr):
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._status: int | None = status
        self._lifeline: int | None = lifeline
        self._reading = threading.Lock()

    def exit_fd(self) -> int | None:
        """Readable once the rank has ended and the template has written its status (None once that is read)."""
        return self._status

    def poll(self) -> int | None:
        with self._reading:  # the job's thread and the notebook's (alive, stacks) may both ask
            if self.returncode is None and self._status is not None:
                if ready_now([self._status]):
                    data = os.read(self._status, 4)
                    os.close(self._status)
                    self._status = None
                    if len(data) == 4:
                        self.returncode = struct.unpack("!i", data)[0]
        if self.returncode is None and self._status is None:  # the template died first: ask the system
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = 255  # gone, with an exit code nobody reaped for us
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            if self._status is not None:
                select.select([self._status], [], [], 0.05)
            else:
                time.sleep(0.02)
        return self.returncode

    def close(self) -> None:
        """Let go of the rank: its lifeline (the rank ends if still running) and its status pipe."""
        with self._reading:
            for name in ("_lifeline", "_status"):
                fd = getattr(self, name)
                if fd is not None:
                    os.close(fd)
                    setattr(self, name, None)


class Template:
    """One template process and this kernel's end of its socket pair."""

    def __init__(self):
        self.fingerprint = _code_fingerprint()
        self.env = template_environment()
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddp_notebook.rank.template", str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=self.env, start_new_session=True, cwd=os.getcwd(),
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self.ready = False
        self.forking = threading.Lock()  # one request on the socket at a time
        log.debug("rank template starting: pid %s", self.proc.pid)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait until the template has imported what ranks need; False if it died or took too long."""
        if self.ready:
            return self.proc.poll() is None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ready, _, _ = select.select([self.sock], [], [], 0.1)
            if ready:
                received = forking.receive(self.sock)
                if received is not None and received[0].get("kind") == forking.READY:
                    self.ready = True
                    log.debug("rank template ready: pid %s", self.proc.pid)
                    return True
                break
        return False

    def usable(self) -> bool:
        """Ready, alive, and started from the torch and ddp_notebook on disk now."""
        return self.proc.poll() is None and self.fingerprint == _code_fingerprint()

    def fork(self, boot: dict, env: dict[str, str], cwd: str, store_fd: int | None) -> ForkedProcess | None:
        """Fork one rank; None when its environment differs from the template's in what is read at start."""
        differs = _start_time_differences(env, self.env)
        if differs:
            log.debug("rank started fresh: %s differ from the template's", ", ".join(differs))
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        status_r, status_w = os.pipe()
        lifeline_r, lifeline_w = os.pipe()
        fds = {"stdout": out_w, "stderr": err_w, "status": status_w, "lifeline": lifeline_r}
        if store_fd is not None:
            fds["store"] = store_fd
        try:
            with self.forking:
                forking.send(self.sock, {"kind": forking.FORK, "boot": boot, "env": env, "cwd": cwd}, fds)
                received = forking.receive(self.sock)
        except BaseException:
            for fd in (out_r, err_r, status_r, lifeline_w):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, status_w, lifeline_r):
                os.close(fd)
        if received is None or "pid" not in received[0]:
            for fd in (out_r, err_r, status_r, lifeline_w):
                os.close(fd)
            raise OSError(f"the rank template could not fork a rank: {received and received[0].get('error')}")
        return ForkedProcess(received[0]["pid"], status_r, lifeline_w, open(out_r, "rb", buffering=0),
                             open(err_r, "rb", buffering=0))

    def stop(self, wait: float = 5.0) -> None:
        try:
            forking.send(self.sock, {"kind": forking.STOP})
        except OSError:
            pass
        self.sock.close()
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.debug("rank template stopped: pid %s", self.proc.pid)


def warm_up() -> "Template | None":
    """Start a template in the background unless one is usable (or templates are off); does not wait."""
    global _current
    if not enabled():
        return None
    with _lock:
        if _current is not None and not _current.usable():
            _current.stop()
            _current = None
        if _current is None:
            try:
                _current = Template()
            except OSError as exc:
                log.debug("rank template not started: %s", exc)
                return None
        return _current


def ready_template() -> "Template | None":
    """A template ready to fork from (started now and waited for, if need be); None if off or it failed."""
    global _current
    with _lock:
        template = warm_up()
        if template is None:
            return None
        if template.wait_ready():
            return template
        log.debug("rank template failed to start: ranks start fresh")
        template.stop(wait=1.0)
        _current = None
        return None


def stop() -> None:
    """Stop the template, if one is up (ranks forked from it are not touched)."""
    global _current
    with _lock:
        if _current is not None:
            _current.stop()
            _current = None


def current_pid() -> int | None:
    """The running template's process id, if one is up."""
    template = _current
    return template.proc.pid if template is not None and template.proc.poll() is None else None


atexit.register(stop)
