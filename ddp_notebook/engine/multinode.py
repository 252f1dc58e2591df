"""A job on several hosts, with the notebook's host as node 0 of torchrun's static rendezvous.

The notebook exports the task (:mod:`ddp_notebook.exporting`) together with its
channel's address and key, then runs this host's ranks the way every other host
runs its own: a real torchrun agent (:mod:`~ddp_notebook.engine.torchrun_agent`: torchrun
with ``--nnodes N --nproc-per-node n`` and the static rendezvous on HOST:P), which also
hosts the rendezvous store that the other hosts' agents join (torchrun's static
rendezvous expects an agent on node 0).  The port is bound when the job is checked
and handed to the agent's store as it is: no one else can take it in between.
Every rank of every node connects back to the notebook's channel, proves it holds the job's key, and then talks to the
notebook exactly as a notebook's own rank does (:mod:`ddp_notebook.runner`), so
results, failures and ``report()`` of all nodes reach the :class:`~ddp_notebook.engine.job.Job`
and its dashboard.

The agent runs in a session of its own, its output relayed with rank prefixes
(torchrun's ``--tee`` with our line prefix).  Stopping the job ends the agent,
its ranks and whatever they started, and closes the channel, which stops the
other nodes' ranks at once (a rank whose notebook is gone exits).  Notebook side.
"""
from __future__ import annotations

import codecs
import os
import re
import socket
import subprocess
import sys
import time

from . import export as exporting
from ..wire.channel import ChannelServer
from ..wire.errors import LaunchError
from .backend import ChannelRanks, rank_environment
from .spec import bind_port

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
    try:  # (a port in use is refused there); held from now on, and handed to the agent's store
        spec.master_socket = bind_port(master_addr, spec.port)
        spec.port = spec.master_socket.getsockname()[1]
    except OSError as exc:
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


class TorchrunNode(ChannelRanks):
    """Node 0 of a multi-host job: this host's torchrun agent, and the channel every node's ranks join."""

    runs_own_task = True  # every node's ranks run the export

    def __init__(self, spec, relay):
        super().__init__(spec, relay)
        self.local = spec.world_size // spec.nnodes
        self.port = spec.port
        self.exported: exporting.Exported | None = None
        self._agent_ended = False
        self._stopping = False
        self._partial = {"stdout": "", "stderr": ""}
        self._decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in self._partial}

    def launch(self, task, task_id: int) -> None:
        spec = self.spec  # (the workdir holds the agent's logs)
        self.channel = ChannelServer(_channel_host(spec.master_addr))
        notebook = {"address": [spec.master_addr, self.channel.address[1]], "key": self.channel.key.hex(),
                    "task": task_id, "job_dir": self.workdir}
        self.exported = exporting.write(task, spec.export_path, seed=spec.seed, timeout=spec.timeout,
                                        backend=spec.backend, notebook=notebook)
        self._start_agent()

    def _start_agent(self) -> None:
        spec = self.spec
        from . import torchrun_agent  # (torch: only once a job on several hosts starts)

        listen_fd = spec.master_socket.fileno()
        cmd = [sys.executable, "-m", torchrun_agent.__name__, "--nnodes", str(spec.nnodes),
               "--nproc-per-node", str(self.local), *torchrun_agent.agent_arguments(spec.master_addr, self.port,
                                                                                    listen_fd),
               "--tee", "3", "--log-dir", os.path.join(self.workdir, "logs"), self.exported.script]
        env = rank_environment(spec, self.port, -1, -1, self.local)  # the agent sets each rank's own variables
        env.update(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE=_PREFIX_TEMPLATE)
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, cwd=os.getcwd(), start_new_session=True, pass_fds=(listen_fd,))
        finally:
            spec.master_socket.close()  # the agent's from here on
        self.procs.append(proc)
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.pipes[pipe.fileno()] = (-1, stream)

    # -- the agent's output: torchrun prefixes each rank's lines --------------------------------
    def read_output(self, fd: int) -> None:
        _, stream = self.pipes[fd]
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        final = not data
        if final:
            del self.pipes[fd]
        text = self._partial[stream] + self._decoders[stream].decode(data, final)
        lines = text.split("\n")
        self._partial[stream] = "" if final else lines.pop()
        for line in lines if not final else [line for line in lines if line]:
            match = _PREFIX.match(line)
            if match:
                self.relay.feed(int(match.group(1)), stream, (line[match.end():] + "\n").encode())
            elif not self._stopping:
                self.relay.feed(-1, stream, (line + "\n").encode())

    def drain(self, rank: int) -> None:
        """That rank's messages, and the agent's output."""
        super().drain(rank)
        self._drain_agent()

    def _drain_agent(self) -> None:
        """The agent's output up to its end, within a second (a stray might hold the pipe open)."""
        deadline = time.monotonic() + 1.0
        while self.pipes and time.monotonic() < deadline:
            for fd in list(self.pipes):
                self.read_output(fd)
            time.sleep(0.01)

    # -- who has ended: ranks by their connection, node 0's also by the agent -------------------
    def check_exits(self) -> None:
        self._lost_are_exited()
        agent = self.procs[0] if self.procs else None
        if agent is not None and not self._agent_ended and agent.poll() is not None:
            self._agent_ended = True
            self._drain_agent()
            for conn in list(self.connections):  # a rank's last words (its error, its result) come first
                self.read_connection(conn)
            self._lost_are_exited()
            for rank in range(self.local):  # node 0's ranks that never said goodbye
                if rank not in self.exited:
                    self.exited[rank] = agent.returncode
                    self._on_exit(rank, agent.returncode)

    def _lost_are_exited(self) -> None:
        for rank in self.lost_ranks():
            if rank not in self.exited:
                self.exited[rank] = None  # its exit status is its host's to know
                self._on_exit(rank, None)

    def shut_down(self, wait: float = 10.0) -> None:
        """The job is done: let this host's agent end with its ranks, then stop whatever is left."""
        deadline = time.monotonic() + wait
        while self.procs and self.procs[0].poll() is None and time.monotonic() < deadline:
            self.pump(0.05)
        self.kill()

    def kill(self) -> None:
        self._stopping = True  # what the agent says from here on is about being stopped: not shown
        super().kill()

    @property
    def alive(self) -> list[int]:
        return [] if not self.procs or self.procs[0].poll() is not None else \
            [r for r in range(self.local) if r not in self.exited]
