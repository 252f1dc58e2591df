"""A job on several hosts, with the notebook's host as node 0 of torchrun's static rendezvous.

The notebook exports the task (:mod:`ddp_notebook.exporting`) together with its
channel's address and key, then runs this host's ranks the way every other host
runs its own: a real torchrun agent, ``torchrun --nnodes N --node-rank 0
--nproc-per-node n --master-addr HOST --master-port P <script>``, which also
hosts the rendezvous store that the other hosts' agents join (torchrun's static
rendezvous expects an agent on node 0).  Every rank of every node connects back
to the notebook's channel, proves it holds the job's key, and then talks to the
notebook exactly as a notebook's own rank does (:mod:`ddp_notebook.runner`), so
results, failures and ``report()`` of all nodes reach the :class:`~ddp_notebook.launcher.Job`
and its dashboard.

The agent runs in a session of its own, its output relayed with rank prefixes
(torchrun's ``--tee`` with our line prefix).  Stopping the job ends the agent,
its ranks and whatever they started, and closes the channel, which stops the
other nodes' ranks at once (a rank whose notebook is gone exits).  Notebook side.
"""
from __future__ import annotations

import codecs
import errno
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

from . import exporting
from .channel import ChannelServer
from .errors import LaunchError
from .ranks import RankGroup

NODE_STARTUP_TIMEOUT_S = 600.0  # the other hosts are started by hand: give them time to join
DEFAULT_EXPORT = "ddp_node_job.py"
_PREFIX = re.compile(r"\[ddp_notebook (\d+)\]:")
_PREFIX_TEMPLATE = "[ddp_notebook ${rank}]:"


def node_spec(spec, nnodes, node_rank, master_addr, export_path):
    """Turn the spec of this host's ranks into node 0's part of a job on ``nnodes`` hosts, or refuse."""
    if isinstance(nnodes, bool) or not isinstance(nnodes, int) or nnodes < 2:
        raise LaunchError(f"nnodes must be a number of hosts, 2 or more, not {nnodes!r}")
    if node_rank not in (0, None):
        raise LaunchError(f"the notebook runs node 0 (it hosts the rendezvous), not node {node_rank}; "
                          f"run the other nodes with torchrun and the export (--export)")
    if not master_addr:
        raise LaunchError("--nnodes needs --master-addr: this host's address, as the other hosts reach it")
    local = spec.world_size
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((master_addr, spec.port or 0))
            spec.port = sock.getsockname()[1]
    except OSError as exc:
        if spec.port:
            if exc.errno == errno.EADDRINUSE:
                raise LaunchError(f"port {spec.port} is already in use on {master_addr}; pick another or leave "
                                  f"--port out for a free one. No rank was started.") from None
        raise LaunchError(f"--master-addr {master_addr} is not an address of this host ({exc.strerror or exc}): "
                          f"the notebook runs node 0, which hosts the master; give this host's address as the "
                          f"other hosts reach it") from None
    spec.nnodes = nnodes
    spec.world_size = local * nnodes
    spec.master_addr = master_addr
    spec.export_path = os.path.abspath(os.path.expanduser(export_path or DEFAULT_EXPORT))
    spec.startup_timeout = max(spec.startup_timeout, NODE_STARTUP_TIMEOUT_S)
    spec.notes.append(other_nodes_text(spec))
    return spec


def other_nodes_text(spec) -> str:
    local = spec.world_size // spec.nnodes
    others = "1" if spec.nnodes == 2 else f"1..{spec.nnodes - 1}"
    ranks = "rank 0" if local == 1 else f"ranks 0-{local - 1}"
    return (f"this host is node 0 of {spec.nnodes} ({ranks} of {spec.world_size}); start the other "
            f"nodes (I = {others}), each with the files of {os.path.basename(spec.export_path)} beside it:\n"
            f"  torchrun --nnodes {spec.nnodes} --node-rank I --nproc-per-node {local} --master-addr "
            f"{spec.master_addr} --master-port {spec.port} {spec.export_path}")


def _channel_host(master_addr: str) -> str:
    """Listen where the other hosts reach us: everywhere, unless the master is this host's loopback."""
    try:
        if socket.gethostbyname(master_addr).startswith("127."):
            return "127.0.0.1"
    except OSError:
        pass
    return "0.0.0.0"


class NodeGroup(RankGroup):
    """Node 0 of a multi-host job: this host's torchrun agent, and the channel every node's ranks join."""

    def __init__(self, spec, relay, task, task_id: int):
        super().__init__(spec, relay)
        self.task = task
        self.task_id = task_id
        self.local = spec.world_size // spec.nnodes
        self.port = spec.port
        self.exported: exporting.Exported | None = None
        self._agent_ended = False
        self._stopping = False
        self._conn_rank: dict = {}  # connection -> rank, kept to notice a lost connection
        self._partial = {"stdout": "", "stderr": ""}
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._partial}

    def start(self, store_sock=None) -> "NodeGroup":
        spec = self.spec
        self.started_at = time.time()
        self.workdir = tempfile.mkdtemp(prefix="ddp_notebook-")  # the agent's logs
        try:
            self._channel = ChannelServer(_channel_host(spec.master_addr))
            notebook = {"address": [spec.master_addr, self._channel.address[1]], "key": self._channel.key.hex(),
                        "task": self.task_id, "job_dir": self.workdir}
            self.exported = exporting.write(self.task, spec.export_path, seed=spec.seed, timeout=spec.timeout,
                                            backend=spec.backend, notebook=notebook)
            self._start_agent()
        except BaseException:
            self.kill()
            raise
        return self

    def _start_agent(self) -> None:
        spec = self.spec
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(spec.nnodes), "--node-rank", "0",
               "--nproc-per-node", str(self.local), "--master-addr", spec.master_addr, "--master-port",
               str(self.port), "--tee", "3", "--log-dir", os.path.join(self.workdir, "logs"), self.exported.script]
        env = dict(os.environ)
        env.update(spec.env)
        env.update(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=_PREFIX_TEMPLATE, PYTHONUNBUFFERED="1")
        if "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.local))
        if spec.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpus)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env.pop("MPLBACKEND", None)  # the kernel's matplotlib backend would make every rank import ipykernel
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=env, cwd=os.getcwd(), start_new_session=True)
        self._procs.append(proc)
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self._pipes[pipe.fileno()] = (-1, stream)

    # -- the agent's output: torchrun prefixes each rank's lines --------------------------------
    def _read_pipe(self, fd: int) -> None:
        _, stream = self._pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        final = not data
        if final:
            del self._pipes[fd]
        text = self._partial[stream] + self._decoders[stream].decode(data, final)
        lines = text.split("\n")
        self._partial[stream] = "" if final else lines.pop()
        for line in lines if not final else [line for line in lines if line]:
            match = _PREFIX.match(line)
            if match:
                self.relay.feed(int(match.group(1)), stream, (line[match.end():] + "\n").encode())
            elif not self._stopping:
                self.relay.feed(-1, stream, (line + "\n").encode())

    def _drain(self, rank: int) -> None:
        super()._drain(rank)  # that rank's messages
        self._drain_agent()

    def _drain_agent(self) -> None:
        """The agent's output up to its end, within a second (a stray might hold the pipe open)."""
        deadline = time.monotonic() + 1.0
        while self._pipes and time.monotonic() < deadline:
            for fd in list(self._pipes):
                self._read_pipe(fd)
            time.sleep(0.01)

    # -- who has ended: ranks by their connection, node 0's also by the agent -------------------
    def _notice_exits(self) -> None:
        for conn, rank in self._conns.items():
            if rank >= 0:
                self._conn_rank[conn] = rank
        for conn in [c for c in self._conn_rank if c not in self._conns]:
            rank = self._conn_rank.pop(conn)
            if rank not in self.exited:
                self.exited[rank] = None  # its exit status is its host's to know
                self.on_exit(rank, None)
        agent = self._procs[0] if self._procs else None
        if agent is not None and not self._agent_ended and agent.poll() is not None:
            self._agent_ended = True
            self._drain_agent()
            for rank in range(self.local):  # node 0's ranks that never said goodbye
                if rank not in self.exited:
                    self.exited[rank] = agent.returncode
                    self.on_exit(rank, agent.returncode)

    def shut_down(self, wait: float = 10.0) -> None:
        """The job is done: let this host's agent end with its ranks, then stop whatever is left."""
        deadline = time.monotonic() + wait
        while self._procs and self._procs[0].poll() is None and time.monotonic() < deadline:
            self.pump(0.05)
        self.kill()

    def kill(self) -> None:
        self._stopping = True  # what the agent says from here on is about being stopped: not shown
        super().kill()

    @property
    def alive(self) -> list[int]:
        return [] if not self._procs or self._procs[0].poll() is not None else \
            [r for r in range(self.local) if r not in self.exited]
