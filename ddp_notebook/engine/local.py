"""The rank processes of a job or a warm pool: start them, relay what they say, stop them.

Each rank is ``python -m ddp_notebook.rank.worker`` in its own session (so Jupyter's
interrupt does not reach it; the notebook decides), with the torchrun
environment contract, and a JSON bootstrap that holds the channel key (never
on the command line).  It is forked from the rank template when one is up
(:mod:`~ddp_notebook.engine.template`: no torch import to wait for), else
started fresh with the bootstrap on its stdin.  Messages from a rank go to the job once the rank
has said who it is (:class:`~ddp_notebook.engine.backend.ChannelRanks`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from typing import Any

from ..wire import protocol
from ..wire.channel import ChannelServer
from . import template as rank_template
from .backend import ChannelRanks, rank_environment
from .spec import bind_port, free_port


class LocalRanks(ChannelRanks):
    """Every rank a process of this host in its own session: forked from the rank template, or started fresh.

    The process group meets in a ``FileStore`` in the job's 0700 folder, out of other users' reach; with a port
    given (``--port``), in rank 0's ``TCPStore`` on it.
    """

    def __init__(self, spec, relay):
        super().__init__(spec, relay)
        self._port_held: socket.socket | None = None  # MASTER_PORT, bound (not listening) while the ranks run
        self._libraries: dict[str, str] = {}  # the notebook's libraries the working folder would shadow -> their files

    def close(self) -> None:
        super().close()
        for proc in self.procs:
            if isinstance(proc, rank_template.ForkedProcess):
                proc.close()
        if self._port_held is not None:
            self._port_held.close()
            self._port_held = None

    @property
    def _store_file(self) -> str:
        """Where the ranks of a job without ``--port`` meet (a FileStore in the job's private folder)."""
        return os.path.join(self.workdir, "store")

    def launch(self, task: Any, task_id: int) -> None:
        spec = self.spec
        store_sock = None
        try:
            if spec.init_group and spec.port is None:  # (the port only for code that reads MASTER_PORT: one
                self._port_held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # per job, like the others')
                self._port_held.bind((spec.master_addr, 0))
                self.port = self._port_held.getsockname()[1]
                # The ranks' FileStore: private like every file of the job (torch would make it with the umask).
                store = os.open(self._store_file,
                                os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                os.fchmod(store, 0o600)
                os.close(store)
            elif spec.init_group:  # rank 0's TCPStore takes over a socket bound here: no one can take the port
                store_sock = bind_port(spec.master_addr, spec.port)
                self.port = store_sock.getsockname()[1]
            elif self.port is None:
                self.port = spec.port or free_port(spec.master_addr)
            self.channel = ChannelServer(spec.master_addr)
            self._libraries = rank_template.shadowed_libraries()
            template = rank_template.for_job()
            try:
                for rank in range(spec.world_size):
                    self._start_rank(rank, store_sock, template)
            finally:
                if template is not None:
                    template.release()
        finally:
            if store_sock is not None:
                store_sock.close()  # rank 0 holds its own copy

    def _start_rank(self, rank: int, store_sock: socket.socket | None,
                    template: "rank_template.Template | None") -> None:
        spec = self.spec
        pass_fds = ()
        start = protocol.RankStart(
            rank=rank, local_rank=rank, world_size=spec.world_size, local_world_size=spec.world_size,
            address=tuple(self.channel.address), key=self.channel.key.hex(),
            parent_pid=os.getpid(), sys_path=[p if p else os.getcwd() for p in sys.path],
            # spawn() leaves devices to the user's code, as mp.spawn does: no set_device for it.
            gpus=spec.gpus is not None and spec.init_group, backend=spec.backend, init_group=spec.init_group,
            user_picks_gpu=spec.gpus is not None and not spec.init_group,
            master_addr=spec.master_addr, master_port=self.port,
            store_file=self._store_file if spec.init_group and spec.port is None else None,
            timeout=spec.timeout, startup_timeout=spec.startup_timeout, job_dir=self.workdir,
            libraries=self._libraries)
        env = rank_environment(spec, self.port, rank, rank, spec.world_size)
        store_fd = store_sock.fileno() if rank == 0 and store_sock is not None else None
        proc = template.fork(start.to_json(), env, os.getcwd(), store_fd) if template is not None else None
        if proc is None:
            if store_fd is not None:
                os.set_inheritable(store_fd, True)
                pass_fds = (store_fd,)
                start = dataclasses.replace(start, store_fd=store_fd)
            proc = subprocess.Popen(
                rank_template.python_module_command("ddp_notebook.rank.worker"), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=os.getcwd(), start_new_session=True,
                pass_fds=pass_fds,
            )
            proc.stdin.write(json.dumps(start.to_json()).encode())
            proc.stdin.close()
        self.procs.append(proc)
        self.pids[rank] = proc.pid
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.pipes[pipe.fileno()] = (rank, stream)
