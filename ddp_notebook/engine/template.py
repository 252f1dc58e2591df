"""The rank template: a process that has imported torch, from which this kernel's ranks are forked.

A cold job's ranks would each spend a second or more importing torch (and keep
their own ~240 MB copy of it); forked from the template they start at once and
share its pages.  The template (``python -m ddp_notebook.rank.template``) never
touches CUDA, so CUDA used in the kernel does not matter; each rank takes its
own session, pipes, environment, directory and ``sys.path`` of the moment it
is forked.  The template is started in the background (when the extension
loads, or at the first launch) and replaced when torch,
ddp_notebook or a library it preloaded changed on disk, or it died; it goes
with the kernel, with ``%ddp_stop`` and :func:`stop`.
``DDP_NOTEBOOK_TEMPLATE=0`` turns it off: every rank is then a fresh
``python -m ddp_notebook.rank.worker``.

Once ready it preloads, one module at a time between fork requests,
``torch._dynamo`` and the libraries the notebook has imported
(:func:`notebook_libraries`), after each job's ranks are forked and after
each cell.  A library that fails to import or leaves the template unfit to
fork (a thread, CUDA) is left to the ranks, named in the debug log; a template
it tainted is replaced.  A job's ranks wait for what every rank imports and
at most for the one library being preloaded when the job came.  A job whose
caller cannot wait (a background job's cell, :func:`not_waiting`) forks on
its own thread, once the template is ready (:func:`coming`,
:meth:`Template.ready_for`).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import types
import warnings
from typing import Callable

from ..wire import forking
from ..wire.channel import ready_now
from .backend import PER_RANK_VARIABLES

log = logging.getLogger("ddp_notebook")

READY_TIMEOUT_S = 60.0
# Variables native code reads as it loads, which no look-up in os.environ shows (the template records those of
# Python code): the interpreter's, the C library's, and those of the libraries torch loads (OpenMP, MKL, oneDNN,
# OpenBLAS, gfortran, numpy, Kineto, MPI, libtorch).  Read off torch 2.13's import with a getenv interposer;
# tests/test_template_environment.py reads the torch installed the same way and checks it reads nothing else.
NATIVE_READ_AT_LOAD = ("PYTHON", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "OMP_", "GOMP_", "MKL", "DNNL_",
                       "ONEDNN_", "OPENBLAS_", "GOTO_", "GFORTRAN_", "NPY_", "NUMPY_", "KINETO_", "PYTORCH_",
                       "OPENSSL_", "I_MPI_", "OMPI_", "MPI_", "ACC_DEVICE_", "INTEL_")
# Families read by a native library torch itself does not load, counted only while the template has one mapped:
# Intel's and LLVM's OpenMP read KMP_* (torch's wheels load GNU's libgomp, which does not; scikit-learn sets
# KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK as it imports), pyarrow's jemalloc (in libarrow) reads JE_*.
NATIVE_READ_BY_LIBRARY = {"KMP_": ("libiomp", "libomp"), "JE_": ("libarrow",)}
# libtorch's own, by name: most TORCH_ variables (TORCH_NCCL_*, TORCH_HOME, ...) are read when used.
TORCH_NATIVE_READ_AT_LOAD = frozenset({
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCH_BLAS_PREFER_CUBLASLT", "TORCH_BLAS_PREFER_HIPBLASLT",
    "TORCH_CPP_LOG_LEVEL", "TORCH_CUSTOM_TERMINATE", "TORCH_DISTRIBUTED_DEBUG", "TORCH_LINALG_PREFER_CUSOLVER",
    "TORCH_LINALG_PREFER_HIPSOLVER", "TORCH_ROCM_FA_PREFER_CK", "TORCH_SHOW_CPP_STACKTRACES",
})

# The package's folder, from this file's place in it (importing the package root here would be an import loop).
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What a rank's first DistributedDataParallel(...) imports (about 1 s, 800 modules and 70 MB): the first preloads.
FIRST_PRELOADS = ("torch._dynamo", "torch.nn.parallel")
# The distributions whose modules are Jupyter's own, with everything they require: never preloaded.
JUPYTER_DISTRIBUTIONS = ("ipykernel", "ipywidgets", "jupyter_client", "jupyter_core", "comm")

_lock = threading.RLock()
_current: "Template | None" = None
_left_to_ranks: dict[str, str] = {}  # library -> why the template does not preload it, for this process's life
_waiting = threading.local()
_not_installed: set[str] = set()  # imported modules of no installed distribution, when distributions were read


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


def _stamp(path: str | None) -> tuple:
    """A library's file, and its size and time now: what says it changed on disk."""
    try:
        st = os.stat(path)
    except (OSError, TypeError):
        return (path, None)
    return (path, st.st_mtime_ns, st.st_size)


def _found_without_working_folder(name: str) -> bool:
    """Whether ``import name`` finds a module with the working folder left out of ``sys.path``."""
    cwd = os.getcwd()
    path = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        try:
            if find is not None and find(name, path) is not None:
                return True
        except (ImportError, ValueError, AttributeError, TypeError):
            continue
    return False


def python_module_command(module: str) -> list[str]:
    """``python -m module`` for a process of ours (the template, a fresh rank) whose own imports (ddp_notebook,
    torch, cloudpickle) never come from the working folder, which may be a shared one where others plant files:
    ``-P`` (Python 3.11+) keeps it off ``sys.path``; the rank takes the notebook's path after those imports.  Where
    ddp_notebook itself is found only there (run from its checkout, not installed), the folder stays."""
    if not _found_without_working_folder("ddp_notebook"):
        return [sys.executable, "-m", module]
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module]
    return [sys.executable, "-c", f"import runpy, sys; del sys.path[0]; runpy.run_module({module!r}, "
                                  "run_name='__main__', alter_sys=True)"]


def library_file(name: str) -> str | None:
    """The file this process imported library ``name`` from: the only one the template may preload it from."""
    module = sys.modules.get(name)
    return getattr(module, "__file__", None) if module is not None else None


def shadowed_libraries() -> dict[str, str]:
    """The libraries this process imported (top-level modules, with their files) that a module or package of the same
    name in the working folder would shadow in a process importing them now, with the working folder first on its
    ``sys.path`` as the notebook's is: a rank imports each from the notebook's file (``rank/worker.py``), never a
    file someone planted in a shared folder.  Looked for with one listing of the folder: most jobs find none."""
    cwd = os.getcwd()
    try:
        here = {entry.partition(".")[0] for entry in os.listdir(cwd)}
    except OSError:
        return {}
    shadowed = {}
    for name in here.intersection(sys.modules):
        file = library_file(name)
        if file and os.path.dirname(os.path.abspath(file)) != cwd and not os.path.abspath(file).startswith(
                os.path.join(cwd, name, "")):
            shadowed[name] = file
    return shadowed


@functools.lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions that provide it (about 0.2 s to read)."""
    from importlib import metadata

    imported = {name.partition(".")[0] for name in list(sys.modules)}
    found = metadata.packages_distributions()
    _not_installed.update(imported - set(found))  # imported by now, and of no distribution
    return found


@functools.lru_cache(maxsize=1)
def _jupyter_modules() -> frozenset[str]:
    """The top-level modules of Jupyter's distributions and of every distribution they require."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[str] = set()
    todo = list(JUPYTER_DISTRIBUTIONS)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            required = Requirement(line)
            if required.marker is None or required.marker.evaluate({"extra": ""}):
                todo.append(required.name)
    return frozenset(module for module, dists in _distributions().items()
                     if any(canonicalize_name(d) in seen for d in dists))


def read_installed() -> None:
    """Read which distributions are installed (about 0.2 s), e.g. on a thread as the extension loads, so that no
    cell or job pays for it; until then a job's ranks forked asks the template for no library of the notebook's."""
    try:
        _jupyter_modules()
    except Exception as exc:  # noqa: BLE001 - read again when needed, where it fails loudly
        log.debug("installed distributions not read: %s", exc)


def notebook_libraries(read_again: bool = True) -> list[str]:
    """The installed libraries this process has imported (top-level modules), beyond the standard library,
    Jupyter's own, what ranks set up themselves and what was left to the ranks: what the template preloads.
    ``read_again``: read the installed distributions (again, when a module imported since is of none known);
    without it, none until they were read (:func:`read_installed`)."""
    if not read_again and _distributions.cache_info().currsize == 0:
        return []
    names = {name.partition(".")[0] for name in list(sys.modules)}
    names = {n for n in names if not n.startswith("_") and n not in sys.stdlib_module_names
             and n not in forking.RANK_OWN_MODULES and n not in _left_to_ranks and n != "ddp_notebook"}
    if read_again and names - set(_distributions()) - _not_installed:
        _distributions.cache_clear()  # perhaps installed since (pip in the notebook), or a module of no distribution
    installed = _distributions()
    # The other modules of what ranks set up themselves (matplotlib's mpl_toolkits and pylab import matplotlib).
    rank_own = {dist for name in forking.RANK_OWN_MODULES for dist in installed.get(name, ())}
    return sorted(name for name in names.intersection(installed) - _jupyter_modules()
                  if not rank_own.intersection(installed[name]))


def _imported_modules() -> dict[str, list[str]]:
    """The modules this process has imported below each top-level one, parents first, less those that hold
    something of what ranks set up themselves (``tqdm.notebook``: an ipywidgets bar): they would taint the
    template."""
    found: dict[str, list[str]] = {}
    for name, module in sorted(list(sys.modules.items())):
        library, dot, _ = name.partition(".")
        if dot and getattr(module, "__spec__", None) is not None and not _holds_what_ranks_set_up(name, module):
            found.setdefault(library, []).append(name)
    return found


@functools.lru_cache(maxsize=None)
def _holds_what_ranks_set_up(name: str, module) -> bool:
    # (Reading an attribute may warn, a deprecated alias such as torch.distributed.reduce_op, or raise: a lazy
    # proxy.  Neither is the user's to see after a cell.)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for value in list(vars(module).values()):
            try:
                owner = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(owner, str) and owner.partition(".")[0] in forking.RANK_OWN_MODULES:
                return True
    return False


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


def read_by_native_code(name: str) -> bool:
    """Whether native code of the interpreter or of what torch loads reads variable ``name`` as it loads."""
    return name.startswith(NATIVE_READ_AT_LOAD) or name in TORCH_NATIVE_READ_AT_LOAD


def libraries_reading(name: str) -> tuple[str, ...]:
    """The native libraries (file name beginnings) that read variable ``name`` as they load, where torch itself
    loads none of them (``NATIVE_READ_BY_LIBRARY``); empty for any other variable."""
    return next((libraries for family, libraries in NATIVE_READ_BY_LIBRARY.items() if name.startswith(family)), ())


def mapped_library(pid: int, beginnings: tuple[str, ...]) -> str | None:
    """The file name of a shared library process ``pid`` has mapped that begins with one of ``beginnings``; None if
    it has none.  A process whose maps cannot be read counts as having the first (what it read is not known)."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return beginnings[0]
    for line in lines:
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (" (deleted)" if replaced)
        if len(fields) == 6:
            name = os.path.basename(fields[5].removesuffix(b" (deleted)")).decode(errors="replace")
            if name.startswith(beginnings) and ".so" in name:
                return name
    return None


def changed_variables(env: dict[str, str], since: dict[str, str]) -> list[str]:
    """The variables whose value in ``env`` differs from ``since`` (set, changed or removed), but for those every
    rank or job sets itself."""
    return sorted(name for name in set(env) | set(since)
                  if env.get(name) != since.get(name) and name not in PER_RANK_VARIABLES)


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
                [*python_module_command("ddp_notebook.rank.template"), str(theirs.fileno()), str(os.getpid())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=self.env, start_new_session=True, cwd=os.getcwd(),
            )
        except BaseException:
            self.sock.close()
            raise
        finally:
            theirs.close()
        self.ready = False
        # variable -> what looked it up as the template imported it ("torch", a preloaded library): a fork would
        # not see a later change of it
        self.looked_up: dict[str, str] = {}
        # variable -> (the value, the library) that found it unset and set it so as the template imported it: a
        # fork given that value sees what a fresh rank's imports would have found (one given none lacks the value
        # the import left, as its environment is the notebook's)
        self.set_where_unset: dict[str, tuple[str, str]] = {}
        self.asked: dict[str, tuple] = {}  # library sent to preload -> the stamp of the notebook's file then
        self.asked_modules: set[str] = set()  # the libraries and their modules sent
        self.unanswered = 0
        self.modules_when_asked = 0  # how many modules the notebook had when it last asked
        self.preloaded: list[str] = []
        self.tainted: str | None = None  # the library that made it unfit to fork, and how
        self.forking = threading.RLock()  # one request on the socket at a time
        log.debug("rank template starting: pid %s", self.proc.pid)
        # Read once it is ready, after a job's HOLD if one came by then: what DDP needs, which no import here shows.
        self._ask([[name, [], None] for name in FIRST_PRELOADS])  # (below torch: found where torch was)

    def _take(self, message: dict) -> None:
        """Note what the template said on its own: ready, or a module preloaded (or left to the ranks)."""
        kind = message.get("kind")
        for name in message.get("environment_read", ()):
            self.looked_up.setdefault(name, message.get("module", "torch"))
        for name, value in message.get("environment_set_where_unset", {}).items():
            self.set_where_unset.setdefault(name, (value, message.get("module", "torch")))
        if kind == forking.READY:
            self.ready = True
            log.debug("rank template ready: pid %s", self.proc.pid)
        elif kind == forking.PRELOADED:
            module = message["module"]
            self.unanswered -= 1
            if "error" not in message:
                self.preloaded.append(module)
                skipped = message.get("skipped")
                log.debug("rank template preloaded %s%s", module,
                          f" (not {', '.join(skipped)}: left to the ranks)" if skipped else "")
                return
            _left_to_ranks[module] = message["error"]
            log.debug("rank template: %s left to the ranks (%s)", module, message["error"])
            if message.get("tainted"):
                self.tainted = f"{module} {message['error']}"
                log.debug("rank template pid %s tainted by %s: replaced", self.proc.pid, self.tainted)

    def _receive(self, until: str | None = None, timeout: float | None = None) -> dict | None:
        """Read the template's messages: those there now (``until`` None), or up to one of kind ``until``, which is
        returned (None if the template ended, or ``timeout`` passed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = 0.0 if until is None else 0.1 if deadline is None else \
                min(0.1, max(0.0, deadline - time.monotonic()))
            try:
                readable = select.select([self.sock], [], [], wait)[0]
            except (OSError, ValueError):  # its socket closed: stopped by another thread (%ddp_stop)
                return None
            if not readable:
                if until is None or (deadline is not None and time.monotonic() > deadline) \
                        or self.proc.poll() is not None:
                    return None
                continue
            try:
                received = forking.receive(self.sock)
            except OSError:
                received = None
            if received is None:
                return None
            message, fds = received
            for fd in fds.values():
                os.close(fd)
            if until is not None and message.get("kind") == until:
                return message
            self._take(message)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait until the template has imported what ranks need; False if it died or took too long."""
        with self.forking:
            if not self.ready:
                self._receive()
            if not self.ready and timeout > 0:
                message = self._receive(forking.READY, timeout)
                if message is not None:
                    self._take(message)
            return self.ready and self.proc.poll() is None

    def wait_preloaded(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait until the template has answered every preload asked of it (or is tainted); False if it died or
        took too long."""
        deadline = time.monotonic() + timeout
        with self.forking:
            self._receive()
            while self.tainted is None and self.unanswered > 0:
                message = self._receive(forking.PRELOADED, max(0.0, deadline - time.monotonic()))
                if message is None:
                    return False
                self._take(message)
        return True

    def read_at_import(self, name: str, value: str | None) -> str | None:
        """What read variable ``name`` when the template imported it, so that a rank forked from it with ``name``
        set to ``value`` (None: unset) would not see it as a fresh rank's imports would: Python code that looked it
        up (``"torch"``, a preloaded library), ``"native code"`` (see ``NATIVE_READ_AT_LOAD``), the file name of a
        native library it has loaded that reads it (see ``NATIVE_READ_BY_LIBRARY``), or a library that found it unset
        and set it to another value than ``value``; None when nothing did, or every rank sets it itself."""
        if name in PER_RANK_VARIABLES:
            return None
        if name in self.looked_up:
            return self.looked_up[name]
        if read_by_native_code(name):
            return "native code"
        libraries = libraries_reading(name)
        loaded = mapped_library(self.proc.pid, libraries) if libraries else None
        if loaded is not None:
            return loaded
        default, library = self.set_where_unset.get(name, (None, None))
        return library if value not in (None, default) else None

    def stale_for(self, env: dict[str, str]) -> list[str]:
        """The variables whose value in ``env`` differs from the template's and that it read as it imported, each
        as ``NAME (read by WHAT)``: a rank forked with ``env`` would start from imports that saw other values."""
        with self.forking:
            self._receive()  # what it has said it read since
        readers = {name: self.read_at_import(name, env.get(name)) for name in changed_variables(env, self.env)}
        return [f"{name} (read by {reader})" for name, reader in readers.items() if reader]

    def usable(self) -> bool:
        """Alive, not tainted, and started from the torch, ddp_notebook and preloaded libraries on disk now, and
        from an environment that agrees with the one of now in every variable its imports read
        (:meth:`stale_for`; the ranks take the others as they are when forked)."""
        with self.forking:
            self._receive()
        if self.proc.poll() is not None or self.tainted is not None or self.fingerprint != _code_fingerprint():
            return False
        changed = [name for name, stamp in self.asked.items() if stamp and _stamp(stamp[0]) != stamp]
        if changed:
            log.debug("rank template replaced: %s changed on disk", ", ".join(changed))
            return False
        stale = self.stale_for(template_environment())
        if stale:
            log.debug("rank template replaced: changed since it started, and read as it imported: %s",
                      ", ".join(stale))
            return False
        return True

    def hold(self) -> None:
        """A job's ranks are coming: the template imports nothing between their forks (until :meth:`release`)."""
        with self.forking:
            forking.send(self.sock, {"kind": forking.HOLD})

    def importing_a_library(self) -> bool:
        """Ready, and preloading a library of the notebook's (``torch._dynamo`` and the other imports every rank
        makes are done): an import that may take seconds, which a job's ranks may never need.  Without waiting for
        another thread that forks from it (its state as last read then)."""
        if self.forking.acquire(blocking=False):
            try:
                self._receive()  # what it has said since
            finally:
                self.forking.release()
        first_pending = any(name in self.asked and name not in self.preloaded and name not in _left_to_ranks
                            for name in FIRST_PRELOADS)
        return self.ready and self.unanswered > 0 and not first_pending

    def ready_for(self, stopped: Callable[[], bool], timeout: float = READY_TIMEOUT_S) -> bool:
        """On a job's own thread, for ranks it could not fork as it started (:func:`coming`): wait until this
        template is ready, in short turns that never hold up the notebook's other uses of it (a cell's end asks it
        to preload), and hold it for the ranks (:meth:`release` once they are forked).  False, and not held, if
        ``stopped()`` becomes true, or it ended, failed or was replaced meanwhile: the ranks start fresh then."""
        deadline = time.monotonic() + timeout
        while not self.wait_ready(timeout=0.1):
            if stopped() or self.proc.poll() is not None or time.monotonic() > deadline:
                return False
        with _lock:
            if stopped() or _current is not self:
                return False
            try:
                self.hold()
            except OSError:  # it died as the ranks came
                return False
        return True

    def release(self) -> None:
        """The job's ranks are forked: the template goes on preloading, now with the notebook's new libraries."""
        with self.forking:
            try:
                forking.send(self.sock, {"kind": forking.GO_ON})
            except OSError:
                return  # it died: the next job replaces it
        self.preload(read_again=False)  # (the job is starting: a new library waits for the next cell)

    def preload(self, read_again: bool = True) -> None:
        """Ask the template to import what it has not been asked yet: ``torch._dynamo``, the notebook's libraries
        with the modules of theirs the notebook has imported (a library that loads lazily loads little itself).
        ``read_again``: see :func:`notebook_libraries`."""
        if self.asked and len(sys.modules) == self.modules_when_asked:
            return  # nothing imported since it last asked (most jobs and cells)
        if read_again:  # (without, a library of a distribution not read yet is left out: the cell's end asks again)
            self.modules_when_asked = len(sys.modules)
        steps = []
        modules = _imported_modules()
        for name in (*FIRST_PRELOADS, *notebook_libraries(read_again)):
            if name in _left_to_ranks:
                continue
            new = [m for m in modules.get(name, ()) if m not in self.asked_modules]
            if name not in self.asked or new:
                steps.append([name, new, library_file(name) if "." not in name else None])
        self._ask(steps)

    def _ask(self, steps: list[list]) -> None:
        if not steps:
            return
        with self.forking:
            for name, modules, file in steps:
                if name not in self.asked:
                    self.asked[name] = _stamp(file) if file else ()
                self.asked_modules.update([name, *modules])
            try:
                forking.send(self.sock, {"kind": forking.PRELOAD, "modules": steps,
                                         "sys_path": [p if p else os.getcwd() for p in sys.path]})
            except OSError:
                return
            self.unanswered += len(steps)
        log.debug("rank template asked to preload %s", ", ".join(
            f"{name} ({len(modules)} modules)" if modules else name for name, modules, _ in steps))

    def fork(self, boot: dict, env: dict[str, str], cwd: str, store_fd: int | None) -> ForkedProcess | None:
        """Fork one rank; None (the rank starts fresh) when its environment differs from the template's in a
        variable the template read as it imported (:meth:`stale_for`: a job's own ``env`` of the spec, or a change
        made as the job started), or when the template ended or was tainted as the job came."""
        stale = self.stale_for(env)
        if stale:
            log.debug("rank started fresh: its environment differs from the template's in %s", ", ".join(stale))
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
                received = self._receive(forking.FORKED)
        except OSError as exc:  # its end of the socket is closed if it died as the job came
            received = None
            if not self._ended_within(1.0):
                raise exc from None
        except BaseException:
            for fd in (out_r, err_r, status_r, lifeline_w):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, status_w, lifeline_r):
                os.close(fd)
        if received is None or "pid" not in received:
            for fd in (out_r, err_r, status_r, lifeline_w):
                os.close(fd)
            if received is None:  # it ended (the next job's template is a new one: this one is no longer usable)
                reaped = self._ended_within(1.0)  # (not left a zombie)
                log.debug("rank started fresh: the template (pid %s) ended as the job came (exit code %s)",
                          self.proc.pid, self.proc.returncode if reaped else None)
                return None
            if self.tainted is not None:  # by a preload that ended as the job came
                log.debug("rank started fresh: the template is tainted by %s", self.tainted)
                return None
            raise OSError(f"the rank template could not fork a rank: {received.get('error')}")
        return ForkedProcess(received["pid"], status_r, lifeline_w, open(out_r, "rb", buffering=0),
                             open(err_r, "rb", buffering=0))

    def _ended_within(self, seconds: float) -> bool:
        """Whether the template has ended (reaped now), waiting at most ``seconds`` for one that is ending."""
        try:
            self.proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, wait: float = 5.0) -> None:
        try:
            forking.send(self.sock, {"kind": forking.STOP})
        except OSError:
            pass
        self.sock.close()
        if self.ready and self.unanswered > 0 and self.proc.poll() is None:
            self.proc.terminate()  # it reads STOP only between imports, and holds nothing: not worth waiting for
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


@contextlib.contextmanager
def not_waiting():
    """Jobs started within never wait on this thread for a template that is not ready (:func:`for_job` answers
    None): their ranks are forked from it later, on the job's own thread, while it is :func:`coming`."""
    before = getattr(_waiting, "off", False)
    _waiting.off = True
    try:
        yield
    finally:
        _waiting.off = before


def coming() -> "Template | None":
    """For a job started within :func:`not_waiting`: the template its own thread forks its ranks from once it is
    ready (:meth:`Template.ready_for`), rather than the caller waiting for it (it may be importing torch, and each
    fork takes tens of milliseconds) or the ranks starting fresh beside it, each importing torch again; None when
    templates are off or it failed, or it is importing a library of the notebook's (:meth:`importing_a_library`:
    fresh ranks are sooner), or the caller may wait."""
    if not getattr(_waiting, "off", False) or not enabled():
        return None
    with _lock:
        template = _current
    if template is None or template.proc.poll() is not None:
        return None
    if template.importing_a_library():
        log.debug("rank template importing a library of the notebook's: ranks start fresh")
        return None
    return template


def for_job() -> "Template | None":
    """The template to fork a job's ranks from (started now if none is up, and waited for until it has imported
    what every rank imports), held for them (:meth:`Template.release` once they are forked); None to start them
    fresh: templates are off or it failed.  A caller that does not wait (:func:`not_waiting`) gets None at once,
    and forks from the template :func:`coming` on the job's own thread."""
    global _current
    with _lock:
        template = warm_up()  # a template that is no longer usable is replaced
        if template is None or getattr(_waiting, "off", False):
            return None
        try:
            template.hold()
            if template.wait_ready():
                changed = changed_variables(template_environment(), template.env)
                if changed:
                    log.debug("rank template pid %s: ranks forked with the environment of now; changed since it "
                              "started, and read only when used: %s", template.proc.pid, ", ".join(changed))
                return template
        except OSError:  # it died as the job came
            pass
        log.debug("rank template failed to start: ranks start fresh")
        template.stop(wait=1.0)
        _current = None
        return None


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


def preload_notebook_libraries(*_) -> None:
    """After a cell (IPython's ``post_run_cell``): a ready template preloads the libraries the notebook imported.
    Not while a background job's thread forks ranks from it (the cell would wait for the library being preloaded
    then): their :meth:`Template.release` asks for the preload."""
    with _lock:
        template = _current
        if template is None or not enabled():
            return
        forking = template.forking
        if not forking.acquire(blocking=False):
            return
        try:
            if template.asked and template.tainted is None and len(sys.modules) == template.modules_when_asked \
                    and not template.stale_for(template_environment()):
                return  # (the cheap tests first: nothing imported, no variable the template read changed; most cells)
            template = warm_up()  # a tainted or outdated template is replaced
            if template is not None and template.wait_ready(timeout=0):
                template.preload()
        except OSError as exc:  # never the cell's concern
            log.debug("rank template: no preload after the cell: %s", exc)
        finally:
            forking.release()


def current() -> "Template | None":
    """The template, if one was started (ready or not)."""
    return _current


def left_to_ranks() -> dict[str, str]:
    """The libraries the template does not preload, and why (they failed to import, or tainted a template)."""
    return dict(_left_to_ranks)


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
