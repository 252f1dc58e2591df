"""The rank template: ``python -m ddp_notebook.rank.template FD PID``, a process ranks are forked from.

It imports what every rank imports (torch, numpy, cloudpickle, the rank side
of ddp_notebook) once and never touches CUDA, says it is ready, then waits on
its socket (``FD``, one end of a socket pair whose other end the notebook,
process ``PID``, holds) for requests to fork a rank.  It ends as soon as the
notebook goes, at any moment: while it imports (seconds), a thread watches for
that, and the thread has ended before the first rank is forked.  A forked rank
takes its own session, output pipes, environment, working directory and
``sys.path`` before it runs anything of the job
(:func:`~ddp_notebook.rank.worker.forked_main`).
The template reaps its ranks and writes each one's exit code to the rank's
status pipe.  It also ends when the notebook says so.

Between requests it preloads what the notebook asks for (``torch._dynamo``,
the libraries the notebook imported), one module at a time, so that a rank
never waits for more than one import; a job's ranks hold it (``HOLD`` ...
``GO_ON``) while they are forked.  A module that leaves the template unfit to
fork (a thread, CUDA, a module ranks set up themselves) taints it: it says so
and forks no rank any more.  Rank side: no IPython, ipywidgets or matplotlib
here.
"""
from __future__ import annotations

import collections
import contextlib
import importlib
import importlib.util
import os
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from typing import Callable

from . import heap

# A forked rank's command line reads as a fresh rank's (started as this process was: -P where the working folder is
# kept off sys.path).
RANK_TITLE = ("-P " if getattr(sys.flags, "safe_path", False) else "") + "-m ddp_notebook.rank.worker"
LOOK_FOR_THE_NOTEBOOK_S = 0.2  # how often the template checks that the notebook still lives, when nothing wakes it


def _fork_rank(sock: socket.socket, request: dict, fds: dict[str, int], statuses: dict[int, int],
               wakeup: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        return pid
    try:  # the rank: nothing here may return into the template's loop
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        for fd in wakeup:
            os.close(fd)
        sock.close()
        for status in statuses.values():
            os.close(status)
        os.close(fds.pop("status"))
        devnull = os.open(os.devnull, os.O_RDONLY)
        for target, fd in ((0, devnull), (1, fds.pop("stdout")), (2, fds.pop("stderr"))):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _set_title(f"{sys.executable} {RANK_TITLE}")
        from ..wire import protocol
        from . import worker

        boot = protocol.RankStart.from_json({**request["boot"], **({"store_fd": fds.pop("store")} if "store" in fds
                                                                   else {})})
        sys.argv[:] = [worker.__file__]  # as ``python -m ddp_notebook.rank.worker`` has it
        worker.forked_main(boot, fds.pop("lifeline"))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    finally:
        os._exit(1)


def _set_title(title: str) -> None:
    try:
        import setproctitle
    except ImportError:  # the title is cosmetic: ps shows the template's
        return
    setproctitle.setproctitle(title)


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def _reap(statuses: dict[int, int]) -> None:
    """Write the exit code of each rank that has ended to its status pipe.  The SIGCHLD handler calls it too, so
    that a rank's end reaches the notebook while a preload imports; only ranks already noted are waited for (a
    rank forked a moment ago waits for the loop, which notes it first)."""
    for pid in list(statuses):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped by a call this one interrupted
            continue
        if done == 0:
            continue
        fd = statuses.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, struct.pack("!i", os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            os.close(fd)


def _end_when_the_notebook_goes(sock: socket.socket, notebook: int) -> Callable[[], None]:
    """Until the returned function is called, end this process as soon as the notebook goes: it died (this
    process was handed to another parent) or closed its end of ``sock`` (its end closes late when a process it
    forked holds a copy; a new parent is never late).  A thread watches, as the main thread is busy importing; the
    returned function ends that thread, so that no thread is left when ranks are forked."""
    done_r, done_w = os.pipe()
    poller = select.poll()
    poller.register(sock.fileno(), getattr(select, "POLLRDHUP", 0))  # the closed end; POLLHUP is always reported
    poller.register(done_r, select.POLLIN)

    def watch() -> None:
        while True:
            events = dict(poller.poll(LOOK_FOR_THE_NOTEBOOK_S * 1000))
            if done_r in events:
                return
            if events or os.getppid() != notebook:
                os._exit(0)

    watcher = threading.Thread(target=watch, name="ddp_notebook-template-watch", daemon=True)
    watcher.start()

    def done() -> None:
        os.write(done_w, b"\0")
        watcher.join()
        os.close(done_r)
        os.close(done_w)

    return done


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # native threads too, which threading does not list


def threads_at_a_fork() -> int:
    """This process's threads once its libraries' fork handlers have run, as a fork finds them (a BLAS pool stops
    for a fork and starts again when next used): a child that ends at once is forked to run them."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return _threads()


def taint(threads_before: int) -> str | None:
    """Why this process can no longer fork ranks safely (a fork copies only the calling thread; a rank must start
    without CUDA), or None.  ``threads_before``: what :func:`threads_at_a_fork` said before."""
    threads = threading.active_count() - 1
    if not threads and _threads() > threads_before:
        threads = threads_at_a_fork() - threads_before
    if threads > 0:
        return f"started {threads} thread{'s' if threads > 1 else ''}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "initialised CUDA"
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/nvidia"):
            return f"opened {target}"
    from ..wire.forking import RANK_OWN_MODULES

    imported = [name for name in RANK_OWN_MODULES if name in sys.modules]
    if imported:
        return f"imported {', '.join(imported)}, which ranks set up themselves"
    return None


class EnvironmentReads:
    """What Python code did with ``os.environ`` within :func:`environment_reads`: the variables it looked up by name
    (found or not), less those a module found unset once and then set itself, which are noted with the value left
    (``set_where_unset``: ``os.environ.setdefault``, as scikit-learn, joblib and threadpoolctl set ``KMP_*``; or a
    default worked out and stored, as torch._dynamo's ``TORCHINDUCTOR_CACHE_DIR``)."""

    def __init__(self):
        self.looked_up: set[str] = set()
        self.set_where_unset: dict[str, str] = {}
        self._found_unset_by: dict[str, list[str]] = {}  # name -> the module of each look-up that found it unset
        self._set_by: dict[str, str] = {}  # name -> the module that set it last

    def found_unset(self, name: str, module: str) -> None:
        self._found_unset_by.setdefault(name, []).append(module)

    def was_set(self, name: str, module: str) -> None:
        self._set_by[name] = module

    def settle(self, environ) -> None:
        """At the end: a variable found unset once, by the module that then set it, was set where unset (a fresh
        import, finding the value it would leave, leaves it so); found unset by another module first, it was read."""
        for name, modules in self._found_unset_by.items():
            value = environ.get(name)
            if value is not None and modules == [self._set_by.get(name)]:
                self.looked_up.discard(name)
                self.set_where_unset[name] = value
                _SET_WHERE_UNSET.add(name)


# The variables this process's imports found unset and left set: a later look-up reads the value they left, which a
# fresh process's imports would leave too (where the notebook holds another value, the notebook tells it stale).
_SET_WHERE_UNSET: set[str] = set()
# Where a look-up or a change of os.environ is made from, but for os.environ's own code.
_NOT_THE_CALLER = frozenset({"os", "collections.abc", __name__})  # (_collections_abc names itself collections.abc)


def _calling_module() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _NOT_THE_CALLER:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


class _RecordingEnviron(os._Environ):
    """``os.environ`` while the template imports: notes every variable Python code looks up by name (found or not),
    so that the notebook knows which of its later changes a forked rank would not see.  Looking through the whole
    environment is not a look-up of a name: iterating it (tqdm collects its ``TQDM_`` defaults so), and the reads of
    each variable in turn that follow (``os.environ.copy()``, ``dict(os.environ)``, ``.items()``)."""

    reads = EnvironmentReads()
    listed: collections.deque = collections.deque()  # the names just iterated, which reads in that order follow

    def __iter__(self):
        names = list(super().__iter__())
        _RecordingEnviron.listed = collections.deque(names)
        return iter(names)

    def __getitem__(self, key):
        listed = _RecordingEnviron.listed
        if listed and listed[0] == key:
            listed.popleft()
        else:
            listed.clear()
            self._looked_up(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        _RecordingEnviron.listed.clear()
        self._looked_up(key)
        try:
            os._Environ.__getitem__(self, key)  # (not self[key]: one look-up, not two)
        except KeyError:
            return False
        return True

    def __setitem__(self, key, value):
        _RecordingEnviron.reads.was_set(key, _calling_module())
        super().__setitem__(key, value)

    def _looked_up(self, key) -> None:
        if key in _SET_WHERE_UNSET:
            return
        reads = _RecordingEnviron.reads
        reads.looked_up.add(key)
        try:
            os._Environ.__getitem__(self, key)
        except KeyError:
            reads.found_unset(key, _calling_module())


@contextlib.contextmanager
def environment_reads():
    """Within: what Python code looks up in ``os.environ`` (``os.getenv`` too), or finds unset and sets, is noted in
    the yielded :class:`EnvironmentReads`."""
    reads = EnvironmentReads()
    _RecordingEnviron.reads = reads
    _RecordingEnviron.listed = collections.deque()
    os.environ.__class__ = _RecordingEnviron
    try:
        yield reads
    finally:
        os.environ.__class__ = os._Environ  # a rank forked later has the plain mapping
        reads.settle(os.environ)


def _found_elsewhere(name: str, file: str | None) -> str | None:
    """Where ``import name`` would find library ``name`` now, when that is not ``file``, the notebook's (a module of
    that name planted in the working folder, or another install); None when it is the notebook's, or ``name`` is
    below a module imported already."""
    if file is None or "." in name:
        return None
    try:
        spec = importlib.util.find_spec(name)  # a top-level name: nothing is imported to find it
    except (ImportError, ValueError) as exc:
        return f"not found ({exc})"
    origin = spec.origin if spec is not None else None
    if origin is None or os.path.realpath(origin) != os.path.realpath(file):
        return f"import would load {origin}, not the notebook's {file}"
    return None


def _preload(name: str, modules: list[str], file: str | None, sys_path: list[str], threads_before: int) -> dict:
    """Import library ``name`` from ``file`` (the notebook's) and those of its ``modules`` that import here (the
    rest are the ranks' to import); a library ``import`` would find elsewhere now is left to the ranks."""
    sys.path[:] = sys_path  # the notebook's: where it imports from (a rank takes the one of its start)
    elsewhere = _found_elsewhere(name, file)
    if elsewhere is not None:
        return {"module": name, "error": elsewhere}
    with environment_reads() as read, heap.importing():
        try:
            library = importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - even SystemExit: the ranks import it themselves
            result = {"module": name, "error": f"{type(exc).__name__}: {exc}".strip()}
        else:
            result = {"module": name, "file": getattr(library, "__file__", None)}
            for module in modules:
                try:
                    importlib.import_module(module)
                except BaseException:  # noqa: BLE001 - one the notebook made by other means, or that needs it
                    result.setdefault("skipped", []).append(module)
    result["environment_read"] = sorted(read.looked_up)
    result["environment_set_where_unset"] = read.set_where_unset
    tainted = taint(threads_before)
    if tainted:
        result.update(error=tainted, tainted=True)
    return result


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))  # argv: FD PID
    parent = int(sys.argv[2])
    stop_watching = _end_when_the_notebook_goes(sock, parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the notebook stops it; interrupts are for cells
    os.environ["SPT_NOENV"] = "1"  # setproctitle must leave the environment block (and so /proc/PID/environ) alone
    # Importing pyarrow (datasets, pandas) starts the background purging thread of the jemalloc built into Arrow,
    # which would taint the template; without it jemalloc purges as it frees (Arrow allocates from mimalloc anyway).
    # Read once, when jemalloc starts; a rank takes the notebook's environment all the same.
    os.environ.setdefault("JE_ARROW_MALLOC_CONF", "background_thread:false")
    with environment_reads() as read, heap.importing():
        import cloudpickle  # noqa: F401  what every rank imports, once
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
        import torch.utils.data  # noqa: F401

        from ..wire import channel, forking, payload, sharing  # noqa: F401
        from . import checkpoint, context, data, metrics, worker  # noqa: F401

    stop_watching()  # the loop below watches for the notebook itself
    _set_title(" ".join([sys.executable, "-m", "ddp_notebook.rank.template"]))
    heap.settle()
    statuses: dict[int, int] = {}  # rank pid -> its status pipe
    # A rank's end wakes the loop (a byte on this pipe), so its status reaches the notebook at once.
    child_ended, wake = os.pipe()
    os.set_blocking(child_ended, False)
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda signum, frame: _reap(statuses))  # (also wakes the loop, through the pipe)
    threads_before = threads_at_a_fork()
    forking.send(sock, {"kind": forking.READY, "pid": os.getpid(), "environment_read": sorted(read.looked_up),
                        "environment_set_where_unset": read.set_where_unset})
    # (library, its modules, the file the notebook imported it from)
    to_preload: collections.deque[tuple[str, list[str], str | None]] = collections.deque()
    preload_path = list(sys.path)
    held = False  # a job's ranks are being forked: no import in between
    tainted = None  # what a preload did that makes forks unsafe
    while True:
        busy = bool(to_preload) and not held and tainted is None
        readable, _, _ = select.select([sock, child_ended], [], [], 0 if busy else LOOK_FOR_THE_NOTEBOOK_S)
        if child_ended in readable:
            while _read_some(child_ended):
                pass
        _reap(statuses)
        if os.getppid() != parent:
            break  # the notebook is gone
        if sock not in readable:
            if busy:
                done = _preload(*to_preload.popleft(), preload_path, threads_before)
                tainted = tainted or (done["error"] if done.get("tainted") else None)
                forking.send(sock, {"kind": forking.PRELOADED, **done})
                if not to_preload:
                    heap.settle()
            continue
        try:
            received = forking.receive(sock)
        except OSError:
            break
        if received is None:
            break
        request, fds = received
        if request["kind"] == forking.STOP:
            break
        if request["kind"] in (forking.HOLD, forking.GO_ON):
            held = request["kind"] == forking.HOLD
        elif request["kind"] == forking.PRELOAD:
            to_preload.extend(request["modules"])
            preload_path = request["sys_path"]
        elif tainted is not None:
            forking.send(sock, {"kind": forking.FORKED, "error": f"the template is tainted: {tainted}"})
        else:
            try:
                pid = _fork_rank(sock, request, dict(fds), statuses, (child_ended, wake))
            except OSError as exc:
                os.close(fds.pop("status"))
                forking.send(sock, {"kind": forking.FORKED, "error": str(exc)})
            else:
                statuses[pid] = fds.pop("status")
                forking.send(sock, {"kind": forking.FORKED, "pid": pid})
        for fd in fds.values():
            os.close(fd)
    for fd in statuses.values():
        os.close(fd)  # ranks still running are the notebook's to stop; it sees their status pipes end
    os._exit(0)


if __name__ == "__main__":
    main()
