"""The rank processes of a job or a warm pool: start them, relay what they say, stop them.

Each rank is ``python -m ddp_notebook.worker`` in its own session (so Jupyter's
interrupt does not reach it; the notebook decides), with the torchrun
environment contract, and a JSON bootstrap on stdin that holds the channel key
(never on the command line).  Messages from a rank go to ``handler`` once the
rank has said who it is; what they mean is the business of the job on top.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import wait as wait_ready
from typing import Any, Callable

from .channel import ChannelServer
from .output import OutputRelay


class RankGroup:
    """The processes behind one process group; ``pump()`` moves their output and messages."""

    def __init__(self, spec, relay: OutputRelay):
        self.spec = spec
        self.relay = relay
        self.handler: Callable[[int, str, dict], None] = lambda rank, kind, body: None
        self.on_exit: Callable[[int, int], None] = lambda rank, code: None
        self.pids: dict[int, int] = {}
        self.port: int | None = None
        self.workdir: str | None = None
        self.ready: set[int] = set()
        self.exited: dict[int, int] = {}
        self.started_at: float | None = None
        self._procs: list[subprocess.Popen] = []
        self._pipes: dict[int, tuple[int, str]] = {}  # fd -> (rank, stream)
        self._conns: dict[Any, int] = {}  # connection -> rank (-1 until its hello)
        self._queued: dict[int, list[tuple]] = {}  # messages for ranks not connected yet
        self._channel: ChannelServer | None = None

    # -- start -----------------------------------------------------------
    def start(self, store_sock: socket.socket | None) -> "RankGroup":
        """Start every rank; ``store_sock`` is the listening socket rank 0's TCPStore takes over."""
        spec = self.spec
        self.started_at = time.time()
        self.workdir = tempfile.mkdtemp(prefix="ddp_notebook-")  # mode 0700
        try:
            self._channel = ChannelServer(spec.master_addr)
            for rank in range(spec.world_size):
                self._start_rank(rank, store_sock)
        except BaseException:
            self.kill()  # ranks already started are stopped and reaped too
            raise
        return self

    def rank_env(self, rank: int) -> dict[str, str]:
        spec = self.spec
        env = dict(os.environ)
        env.update(spec.env)
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.world_size), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(spec.world_size), "MASTER_ADDR": spec.master_addr,
            "MASTER_PORT": str(self.port), "PYTHONUNBUFFERED": "1", "DDP_NOTEBOOK_RANK": str(rank),
        })
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
        if spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        # The kernel's matplotlib backend would make every rank import ipykernel.
        env.pop("MPLBACKEND", None)
        return env

    def _start_rank(self, rank: int, store_sock: socket.socket | None) -> None:
        spec = self.spec
        pass_fds = ()
        boot = {
            "rank": rank, "local_rank": rank, "world_size": spec.world_size, "local_world_size": spec.world_size,
            "address": list(self._channel.address), "key": self._channel.key.hex(),
            "parent_pid": os.getpid(), "sys_path": [p if p else os.getcwd() for p in sys.path],
            # spawn() leaves devices to the user's code, as mp.spawn does: no set_device for it.
            "gpus": spec.gpus is not None and spec.init_group, "backend": spec.backend, "init_group": spec.init_group,
            "master_addr": spec.master_addr, "master_port": self.port, "store_fd": None,
            "timeout": spec.timeout, "startup_timeout": spec.startup_timeout, "job_dir": self.workdir,
        }
        if rank == 0 and store_sock is not None:
            os.set_inheritable(store_sock.fileno(), True)
            pass_fds = (store_sock.fileno(),)
            boot["store_fd"] = store_sock.fileno()
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddp_notebook.worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=self.rank_env(rank), cwd=os.getcwd(), start_new_session=True,
            pass_fds=pass_fds,
        )
        self._procs.append(proc)
        self.pids[rank] = proc.pid
        proc.stdin.write(json.dumps(boot).encode())
        proc.stdin.close()
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._pipes[pipe.fileno()] = (rank, stream)

    # -- talk ------------------------------------------------------------
    def send(self, rank: int, message: tuple) -> None:
        """Send to a rank now, or as soon as it has connected."""
        for conn, r in self._conns.items():
            if r == rank:
                try:
                    conn.send(message)
                except OSError:
                    pass  # its exit tells the rest
                return
        self._queued.setdefault(rank, []).append(message)

    def signal(self, ranks, sig: int) -> None:
        for rank in ranks:
            proc = self._procs[rank]
            if proc.poll() is None:
                try:
                    os.kill(proc.pid, sig)
                except ProcessLookupError:
                    pass

    @property
    def alive(self) -> list[int]:
        return [rank for rank, proc in enumerate(self._procs) if proc.poll() is None]

    # -- watch -----------------------------------------------------------
    def pump(self, timeout: float = 0.1) -> None:
        """Wait up to ``timeout`` for output or messages and hand them on; notice exits."""
        self._take_new_connections()
        for obj in wait_ready(list(self._conns) + list(self._pipes), timeout):
            if isinstance(obj, int):
                self._read_pipe(obj)
            else:
                self._read_conn(obj)
        self.relay.maybe_flush()
        self._notice_exits()

    def _take_new_connections(self) -> None:
        if self._channel is not None:
            for conn in self._channel.new_connections():
                self._conns[conn] = -1

    def _notice_exits(self) -> None:
        self._take_new_connections()  # a rank's report may sit on a connection accepted a moment ago
        for rank, proc in enumerate(self._procs):
            if rank not in self.exited and proc.poll() is not None:
                self.exited[rank] = proc.returncode
                self._drain(rank)
                self.on_exit(rank, proc.returncode)

    def _read_pipe(self, fd: int) -> None:
        rank, stream = self._pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        if data:
            self.relay.feed(rank, stream, data)
        else:
            del self._pipes[fd]

    def _read_conn(self, conn) -> None:
        try:
            while conn.poll():
                kind, body = conn.recv()
                rank = self._conns.get(conn, -1)
                if kind == "hello":
                    rank = self._conns[conn] = int(body["rank"])
                    for message in self._queued.pop(rank, []):
                        conn.send(message)
                elif rank < 0:
                    continue  # nothing counts before a rank has said who it is
                elif kind == "ready":
                    self.ready.add(rank)
                self.handler(rank, kind, body)
        except (EOFError, OSError):
            self._conns.pop(conn, None)
            conn.close()

    def _drain(self, rank: int) -> None:
        """Read what an exited rank left in its pipes and its connection (without waiting: a child of the
        rank may still hold its stdout open)."""
        for fd, (r, _) in list(self._pipes.items()):
            if r == rank:
                for _ in range(256):  # at most 16 MiB of leftover output
                    if fd not in self._pipes or not wait_ready([fd], 0):
                        break
                    try:
                        self._read_pipe(fd)
                    except OSError:
                        self._pipes.pop(fd, None)
        for conn, r in list(self._conns.items()):
            if r in (rank, -1):
                self._read_conn(conn)

    # -- stop ------------------------------------------------------------
    def shut_down(self, wait: float = 10.0) -> None:
        """Ask every rank to exit cleanly, then stop whatever is left."""
        for rank in range(len(self._procs)):
            self.send(rank, ("exit", {}))
        deadline = time.monotonic() + wait
        while len(self.exited) < len(self._procs) and time.monotonic() < deadline:
            self.pump(0.05)
        self.kill()

    def kill(self) -> None:
        """Stop every rank (and anything it started), reap them and remove the group's files."""
        try:
            import psutil
        except ImportError:  # pragma: no cover - psutil is a dependency
            psutil = None
        strays = []
        for proc in self._procs:
            if proc.poll() is None and psutil is not None:
                try:
                    strays += psutil.Process(proc.pid).children(recursive=True)
                except psutil.Error:
                    pass
        for proc in self._procs:
            if proc.poll() is not None:  # the rank is gone, but what it started may live on in its group
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [p for p in self._procs if p.poll() is None]
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
        for rank, proc in enumerate(self._procs):
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            self._drain(rank)
        self.relay.flush(final=True)
        for proc in self._procs:
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._pipes.clear()
        self.close()

    def close(self) -> None:
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
