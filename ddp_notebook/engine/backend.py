"""Where the ranks of one attempt run: the interface a job talks to, and what the process backends share.

A :class:`RankBackend` starts the ranks of a job spec, moves their output to
the job's relay and their messages to the job, reports each rank's exit (its
code, a negative signal number, or None when only a lost connection tells),
and stops them.  Implementations: :class:`~ddp_notebook.engine.local.LocalRanks`
(subprocesses of this host) and :class:`~ddp_notebook.engine.multinode.TorchrunNode`
(this host as node 0 under a torchrun agent); a new one (a Slurm allocation)
is one more module with a subclass.  :func:`rank_environment` is the torchrun
environment contract every backend gives its ranks.
"""
from __future__ import annotations

import abc
import contextlib
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterator

from ..wire import protocol
from ..wire.channel import ChannelServer, FrameRefused, readable, receive_now, send_together, whole_message
from .output import OutputRelay

log = logging.getLogger("ddp_notebook")

MessageHandler = Callable[[int, str, dict], None]
ExitHandler = Callable[[int, "int | None"], None]


# What rank_environment sets for each rank (or job) itself: never a reason to start a new rank template (every job
# differs from the template in them).  A forked rank applies OMP_NUM_THREADS itself (rank/worker.py).
PER_RANK_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "DDP_NOTEBOOK_RANK", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER", "MPLBACKEND", "PYTHONUNBUFFERED", "TORCH_FR_BUFFER_SIZE",
})


def rank_environment(spec, port: int | None, rank: int, local_rank: int, local_world_size: int,
                     node: int = 0) -> dict[str, str]:
    """The environment of one rank: the kernel's, the spec's extra variables and the torchrun contract.

    With ``rank`` -1 (a torchrun agent, which sets the per-rank variables itself) only what all ranks share.
    """
    env = dict(os.environ)
    env.update(spec.env)
    env["PYTHONUNBUFFERED"] = "1"
    # job.why(): torch's Flight Recorder keeps each rank's last collectives (read as the process group is made)
    env.setdefault("TORCH_FR_BUFFER_SIZE", protocol.FLIGHT_RECORDER_ENTRIES)
    if rank >= 0:
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(port), "DDP_NOTEBOOK_RANK": str(rank),
        })
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local_world_size))
    if spec.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    # Not the kernel's matplotlib backend (it would make every rank import ipykernel): a rank's own, which
    # sends plt.show()'s figures to the notebook (rank/mpl_backend.py; matplotlib loads it only with pyplot).
    env["MPLBACKEND"] = MPL_BACKEND
    return env


MPL_BACKEND = "module://ddp_notebook.rank.mpl_backend"
_EXITS_EVERY_S = 0.1  # while messages keep a pump busy, how often it still looks for ranks that ended


class RankBackend(abc.ABC):
    """Where the ranks of one attempt run (see the module's docstring); the job uses nothing else of them."""

    #: True when the ranks run the task they were started with (an export); else the job sends it (RUN).
    runs_own_task = False

    @property
    def keeps_failed_rank(self) -> bool:
        """A rank that failed with a Python error can stay at its failure for the debugger (``DEBUG``), and the
        others be ended apart (:meth:`signal`): ranks of this host that serve tasks.  Else it ends with its task."""
        return False

    @abc.abstractmethod
    def signal(self, ranks, sig: int) -> None:
        """Send ``sig`` to these ranks' processes."""

    def __init__(self, spec, relay: OutputRelay):
        self.spec = spec
        self.relay = relay
        self.pids: dict[int, int] = {}
        self.port: int | None = None
        self.workdir: str | None = None
        self.ready: set[int] = set()
        self.exited: dict[int, int | None] = {}
        self.started_at: float | None = None
        self._on_message: MessageHandler = lambda rank, kind, body: None
        self._on_exit: ExitHandler = lambda rank, code: None

    def attach(self, on_message: MessageHandler, on_exit: ExitHandler | None = None) -> None:
        """From now on, rank messages go to ``on_message`` and rank exits to ``on_exit``."""
        self._on_message = on_message
        if on_exit is not None:
            self._on_exit = on_exit

    @contextlib.contextmanager
    def diverted(self, on_message: MessageHandler) -> Iterator[None]:
        """Messages go to ``on_message`` for a while (a warm pool's barrier), then back."""
        previous, self._on_message = self._on_message, on_message
        try:
            yield
        finally:
            self._on_message = previous

    @abc.abstractmethod
    def start(self, task: Any = None, task_id: int = 0) -> "RankBackend":
        """Start every rank; ``task`` is for backends whose ranks run it themselves."""

    def finish_start(self, stopped: Callable[[], bool]) -> None:
        """Start what :meth:`start` left for the job's own thread (hook: local ranks that wait for a rank template
        there, so that a background job's cell returns at once); ``stopped()`` tells that the job was stopped
        meanwhile.  Nothing for most backends."""

    @abc.abstractmethod
    def send(self, rank: int, message: tuple) -> None:
        """Send ``(kind, body)`` to a rank now, or as soon as it has connected."""

    def send_to(self, ranks, message: tuple) -> None:
        """Send one ``(kind, body)`` to each of these ranks."""
        for rank in ranks:
            self.send(rank, message)

    @abc.abstractmethod
    def pump(self, timeout: float = 0.1) -> None:
        """Wait up to ``timeout`` for output or messages and hand them on; notice exits."""

    @property
    @abc.abstractmethod
    def alive(self) -> list[int]:
        """The ranks still running."""

    @abc.abstractmethod
    def shut_down(self, wait: float = 10.0) -> None:
        """The job is done: let the ranks end cleanly, then stop whatever is left."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop every rank and anything it started, and remove what the backend made."""

    def where(self, ranks, wait: float, collectives: bool = True, stack: bool = True) -> dict[int, dict]:
        """What the ranks that the notebook reaches only through the channel (an export's: a Slurm task, a rank of
        another host) say of themselves, asked now: rank -> their ``HERE`` (the Flight Recorder's entries under
        ``collectives``, every thread's stack under ``stack``), for those that answered within ``wait`` seconds.
        The ranks of this host answer through the job's folder instead (``hangs.ask``, ``stacks.collect``)."""
        return {}

    def describe_exit(self, rank: int, code: int | None) -> str:
        """How a rank that ended without a word ended: its exit ``code``, a negative signal number, or None
        when only its lost connection tells."""
        if code is None:
            return f"rank {rank} lost its connection to the notebook (it, its torchrun agent or its host ended) " \
                   f"without reporting an error"
        how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with code {code}"
        if code in (-signal.SIGABRT, 134):
            how += " (abort or crash)"
        elif code == -signal.SIGSEGV:
            how += " (segmentation fault)"
        return f"rank {rank} {how} without reporting an error"


class _Ended(int):
    """A process's exit descriptor in the poll set (:func:`_exit_fd`): readable, a rank has ended.  An int, so that
    an unchanged set compares equal and keeps its poll object."""


def _exit_fd(proc) -> int | None:
    """A descriptor that becomes readable when the process ends, where it has one (a rank forked by the template:
    its status pipe); else None, and only polling tells."""
    exit_fd = getattr(proc, "exit_fd", None)
    return exit_fd() if exit_fd is not None else None


def signal_name(code: int) -> str:
    """SIGKILL for -9: the name of the signal a negative exit code stands for."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class ChannelRanks(RankBackend):
    """Ranks as processes of this host that talk to the notebook over the authenticated channel.

    The shared machinery of the process backends: the channel and its
    connections (each rank says who it is first), the processes' output pipes,
    stopping and reaping.  An implementation starts its processes in
    :meth:`launch` (registering them in ``procs`` and their pipes in ``pipes``)
    and may override the hooks :meth:`read_output`, :meth:`check_exits` and
    :meth:`drain`.
    """

    def __init__(self, spec, relay: OutputRelay):
        super().__init__(spec, relay)
        self.procs: list[subprocess.Popen] = []
        self.pipes: dict[int, tuple[int, str]] = {}  # fd -> (rank, stream); rank -1: the process speaks for many
        self.connections: dict[Any, int] = {}  # connection -> rank (-1 until its hello)
        self.channel: ChannelServer | None = None
        self._queued: dict[int, list[tuple]] = {}  # messages for ranks not connected yet
        self._known: dict[Any, int] = {}  # connection -> rank, kept to notice a lost connection
        self.cut: dict[int, str] = {}  # rank -> why its connection was cut (a message failed its check)
        self._poller: tuple[tuple, Any, dict] | None = None  # (what it watches, select.poll, fd -> object)
        self._exits_checked = 0.0
        self._pumped_by: int | None = None  # the thread that pumps (the job's): where() pumps there, else waits
        self._heard = threading.Condition()
        self._here: dict[int, dict] = {}  # rank -> its latest HERE (where())

    def start(self, task: Any = None, task_id: int = 0) -> "ChannelRanks":
        """Start every rank (:meth:`launch`); what was started is stopped again if that fails."""
        self.started_at = time.time()
        self.workdir = tempfile.mkdtemp(prefix="ddp_notebook-")  # mode 0700
        try:
            self.launch(task, task_id)
        except BaseException:
            self.kill()  # ranks already started are stopped and reaped too
            raise
        log.debug("ranks started: %s, pids %s, port %s", type(self).__name__, self.pids, self.port)
        return self

    @abc.abstractmethod
    def launch(self, task: Any, task_id: int) -> None:
        """Start the processes (an implementation's part of :meth:`start`)."""

    # -- talk ------------------------------------------------------------
    def send(self, rank: int, message: tuple) -> None:
        self.send_to((rank,), message)

    def send_to(self, ranks, message: tuple) -> None:
        """Pickled once for all of them (a cell's task goes to every rank); queued for a rank not connected yet."""
        data = ForkingPickler.dumps(message)
        by_rank = {r: conn for conn, r in self.connections.items() if r >= 0}
        for rank in ranks:
            if rank not in by_rank:
                self._queued.setdefault(rank, []).append(message)
        with whole_message():
            send_together([by_rank[rank] for rank in ranks if rank in by_rank], bytes(data))  # a failed send: the
            # rank's exit tells the rest

    @property
    def keeps_failed_rank(self) -> bool:
        return not self.runs_own_task  # (an export's ranks, of several hosts or a Slurm job, end with their task)

    def signal(self, ranks, sig: int) -> None:
        """Send ``sig`` to these ranks' processes."""
        for rank in ranks:
            if rank >= len(self.procs):
                continue  # not started yet (finish_start)
            proc = self.procs[rank]
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    @property
    def alive(self) -> list[int]:
        return [rank for rank, proc in enumerate(self.procs) if proc.poll() is None]

    def where(self, ranks, wait: float, collectives: bool = True, stack: bool = True) -> dict[int, dict]:
        if not self.runs_own_task:
            return {}  # (a notebook's own ranks read their channel between tasks alone)
        connected = {r for r in self.connections.values() if r >= 0}
        asked = [r for r in ranks if r in connected and r not in self.exited]
        if not asked:
            return {}
        with self._heard:
            for rank in asked:
                self._here.pop(rank, None)  # (an answer is taken by arrival: the ranks' clocks may differ)
        self.send_to(asked, (protocol.WHERE, {"collectives": collectives, "stack": stack}))
        deadline = time.monotonic() + wait

        def answered() -> dict[int, dict]:
            with self._heard:
                return {r: self._here[r] for r in asked if r in self._here}

        while len(answered()) < len(asked) and time.monotonic() < deadline:
            if self._pumped_by in (None, threading.get_ident()):
                self.pump(min(0.05, max(0.0, deadline - time.monotonic())))
            else:
                with self._heard:
                    self._heard.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return answered()

    # -- watch -----------------------------------------------------------
    def pump(self, timeout: float = 0.1) -> None:
        self._pumped_by = threading.get_ident()
        self.take_new_connections()
        ready = self._ready(timeout)
        connected = len(self.connections)
        exited = False
        for obj in ready:
            if isinstance(obj, _Ended):
                exited = True
            elif isinstance(obj, int):
                self.read_output(obj)
            elif obj is self.channel:
                before = len(self.connections)
                self.take_new_connections()
                connected += len(self.connections) - before
            else:
                self.read_connection(obj, drain=False)
        self.relay.maybe_flush()
        now = time.monotonic()
        # Ranks' exits: a process poll per rank, so not in every pump while messages flow.
        if not ready or exited or len(self.connections) < connected or now - self._exits_checked >= _EXITS_EVERY_S:
            self._exits_checked = now
            self.check_exits()

    def _ready(self, timeout: float) -> list:
        """What has something to read (or closed), waiting up to ``timeout`` seconds: connections, output pipes,
        the channel (a rank connected) and processes that tell their end by a descriptor (``exit_fd()``).  What
        ``multiprocessing.connection.wait`` answers, with one poll object kept while the set stays the same
        rather than a selector built for every call."""
        ended = [_Ended(fd) for rank, proc in enumerate(self.procs)  # each descriptor read once: another thread's
                 if rank not in self.exited and (fd := _exit_fd(proc)) is not None]  # poll() may close it
        watched = (*self.connections, *self.pipes, *([self.channel] if self.channel is not None else []), *ended)
        if self._poller is None or self._poller[0] != watched:
            poller, objects = select.poll(), {}
            for obj in watched:
                fd = obj if isinstance(obj, int) else obj.fileno()
                poller.register(fd, select.POLLIN)
                objects[fd] = obj
            self._poller = (watched, poller, objects)
        _, poller, objects = self._poller
        return [objects[fd] for fd, _ in poller.poll(math.ceil(timeout * 1000))]

    def take_new_connections(self) -> None:
        """Adopt the connections the channel has authenticated since the last call."""
        if self.channel is not None:
            for conn in self.channel.new_connections():
                self.connections[conn] = -1

    def lost_ranks(self) -> list[int]:
        """The ranks whose connection has closed since the last call: where the ranks are not this host's own
        processes, all that tells they have ended."""
        for conn, rank in self.connections.items():
            if rank >= 0:
                self._known[conn] = rank
        return [self._known.pop(conn) for conn in [c for c in self._known if c not in self.connections]]

    def check_exits(self) -> None:
        """Record ranks whose process has ended, and tell the job (hook: processes of other kinds)."""
        self.take_new_connections()  # a rank's report may sit on a connection accepted a moment ago
        for rank, proc in enumerate(self.procs):
            if rank not in self.exited and proc.poll() is not None:
                self.exited[rank] = proc.returncode
                log.debug("rank %s exited with %s", rank, proc.returncode)
                self.drain(rank)
                self._on_exit(rank, proc.returncode)

    def read_output(self, fd: int) -> None:
        """Read what a rank wrote to one of its pipes (hook: output that interleaves several ranks)."""
        rank, stream = self.pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.relay.feed(rank, stream, data)
        else:
            del self.pipes[fd]

    def read_connection(self, conn, drain: bool = True) -> None:
        """Hand on the messages waiting on one connection; with ``drain`` False, the one message known to be
        there (whether more wait, the next poll of every connection tells: each extra call may hand off the
        GIL, which costs a cell of the warm pool when the kernel's own threads are busy)."""
        try:
            while not drain or readable(conn):
                with whole_message():
                    whole, message = receive_now(conn)  # (without a thread switch when it is all there)
                    kind, body = message if whole else conn.recv()
                self._take(conn, kind, body)
                if not drain:
                    return
        except (EOFError, OSError) as exc:
            rank = self.connections.pop(conn, None)
            conn.close()
            if isinstance(exc, FrameRefused):
                log.warning("rank %s: %s", rank, exc)
                if rank is not None and rank >= 0:
                    self.cut[rank] = str(exc)

    def _take(self, conn, kind: str, body: dict) -> None:
        rank = self.connections.get(conn, -1)
        if kind == protocol.HELLO:  # known from now on, so that its connection's end tells its exit (lost_ranks)
            rank = self.connections[conn] = self._known[conn] = int(body["rank"])
            for message in self._queued.pop(rank, []):
                with whole_message():
                    conn.send(message)
        elif rank < 0:
            return  # nothing counts before a rank has said who it is
        elif kind == protocol.READY:
            self.ready.add(rank)
        elif kind == protocol.HERE:  # (the answer to where(): not news of the job, nor its progress)
            with self._heard:
                self._here[rank] = body
                self._heard.notify_all()
            return
        log.debug("rank %s: %s %s", rank, kind, sorted(body))
        self.handle(rank, kind, body)

    def describe_exit(self, rank: int, code: int | None) -> str:
        if rank in self.cut:
            return f"rank {rank}'s connection to the notebook was cut: {self.cut[rank]}"
        return super().describe_exit(rank, code)

    def handle(self, rank: int, kind: str, body: dict) -> None:
        """A rank's message, once it has said who it is (hook: messages a backend acts on itself)."""
        self._on_message(rank, kind, body)

    def drain(self, rank: int) -> None:
        """Read what an exited rank left in its pipes and its connection (without waiting: a child of the
        rank may still hold its stdout open)."""
        for fd, (r, _) in list(self.pipes.items()):
            if r == rank:
                for _ in range(256):  # at most 16 MiB of leftover output
                    if fd not in self.pipes or not wait_ready([fd], 0):
                        break
                    try:
                        self.read_output(fd)
                    except OSError:
                        self.pipes.pop(fd, None)
        for conn, r in list(self.connections.items()):
            if r in (rank, -1):
                self.read_connection(conn)

    # -- stop ------------------------------------------------------------
    def shut_down(self, wait: float = 10.0) -> None:
        for rank in range(len(self.procs)):
            self.send(rank, (protocol.EXIT, {}))
        deadline = time.monotonic() + wait
        while len(self.exited) < len(self.procs) and time.monotonic() < deadline:
            self.pump(0.05)
        self.kill()

    def kill(self) -> None:
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            psutil = None
        strays = []
        for proc in self.procs:
            if proc.poll() is None and psutil is not None:
                try:
                    strays += psutil.Process(proc.pid).children(recursive=True)
                except psutil.Error:
                    pass
        for proc in self.procs:
            if proc.poll() is not None:  # the rank is gone, but what it started may live on in its group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self.procs if p.poll() is None]
            for proc in alive:
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            for child in strays:  # descendants that left the rank's process group
                try:
                    child.send_signal(sig)
                except Exception:
                    pass
            deadline = time.monotonic() + (1.0 if sig == signal.SIGTERM else 5.0)
            while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
                time.sleep(0.02)
            if not any(p.poll() is None for p in alive):
                break
        for rank, proc in enumerate(self.procs):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self.drain(rank)
        self.relay.flush(final=True)
        log.debug("ranks stopped: pids %s, exits %s", self.pids, self.exited)
        for proc in self.procs:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self.pipes.clear()
        self.close()

    def close(self) -> None:
        """Close the channel and remove the group's directory."""
        for conn in list(self.connections):
            conn.close()
        self.connections.clear()
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
