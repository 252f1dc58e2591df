"""The rank processes of a job or a warm pool: start them, relay what they say, stop them.

Each rank is ``python -m ddp_notebook.rank.worker`` in its own session (so Jupyter's
interrupt does not reach it; the notebook decides), with the torchrun
environment contract, and a JSON bootstrap that holds the channel key (never
on the command line).  It is forked from the rank template when one is up
(:mod:`~ddp_notebook.engine.template`: no torch import to wait for; a
background job forks them on its own thread, once the template is ready,
:meth:`LocalRanks.finish_start`), else
started fresh with the bootstrap on its stdin.  Messages from a rank go to the job once the rank
has said who it is (:class:`~ddp_notebook.engine.backend.ChannelRanks`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from ..wire import protocol
from ..wire.channel import ChannelServer
from . import template as rank_template
from .backend import ChannelRanks, rank_environment
from .spec import bind_port, free_port

log = logging.getLogger("ddp_notebook")


class LocalRanks(ChannelRanks):
    """Every rank a process of this host in its own session: forked from the rank template, or started fresh.

    The process group meets in a ``FileStore`` in the job's 0700 folder, out of other users' reach; with a port
    given (``--port``), in rank 0's ``TCPStore`` on it.
    """

    def __init__(self, spec, relay):
        super().__init__(spec, relay)
        self._port_held: socket.socket | None = None  # MASTER_PORT, bound (not listening) while the ranks run
        self._libraries: dict[str, str] = {}  # the notebook's libraries the working folder would shadow -> their files
        # (the template coming, what each rank starts with): ranks left to fork once it is ready (finish_start)
        self._held: tuple[rank_template.Template, list[tuple]] | None = None
        self._held_store: socket.socket | None = None  # rank 0's store socket (--port) meanwhile

    def close(self) -> None:
        super().close()
        for proc in self.procs:
            if isinstance(proc, rank_template.ForkedProcess):
                proc.close()
        if self._port_held is not None:
            self._port_held.close()
            self._port_held = None
        if self._held_store is not None:
            self._held_store.close()
            self._held_store = None
        self._held = None

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
            ranks = [self._rank_start(rank) for rank in range(spec.world_size)]  # (the notebook as it is now)
            template = rank_template.for_job()
            coming = rank_template.coming() if template is None else None
            if coming is not None:
                # A caller that returns at once (a background job): the ranks are forked by the job's own thread
                # (finish_start) once the template is ready, rather than each importing torch afresh beside it.
                log.debug("ranks forked from the rank template by the job's own thread, once it is ready")
                self._held = (coming, ranks)
                self._held_store, store_sock = store_sock, None
                self.started_at = None  # (the start-up bound counts from their start)
                return
            self._start_ranks(ranks, store_sock, template)
        finally:
            if store_sock is not None:
                store_sock.close()  # rank 0 holds its own copy

    def finish_start(self, stopped: Callable[[], bool]) -> None:
        """Fork the ranks a background start left for the job's own thread, once the template is ready (started
        fresh if it ended, failed or was replaced meanwhile); none if the job was stopped meanwhile."""
        held, self._held = self._held, None
        if held is None:
            return
        coming, ranks = held
        store_sock, self._held_store = self._held_store, None
        try:
            template = coming if coming.ready_for(stopped) else None  # (the one the job started with, or fresh)
            if stopped():
                if template is not None:
                    template.release()
                return
            if template is None:
                log.debug("rank template gone or replaced before it was ready: ranks start fresh")
            self.started_at = time.time()
            self._start_ranks(ranks, store_sock, template)
        finally:
            if store_sock is not None:
                store_sock.close()

    def _start_ranks(self, ranks: list[tuple], store_sock: socket.socket | None,
                     template: "rank_template.Template | None") -> None:
        try:
            for rank, (start, env, cwd) in enumerate(ranks):
                self._start_rank(rank, start, env, cwd, store_sock, template)
        finally:
            if template is not None:
                template.release()

    def _rank_start(self, rank: int) -> tuple[protocol.RankStart, dict[str, str], str]:
        """What rank ``rank`` starts with, read from the notebook now: its bootstrap, environment and folder."""
        spec = self.spec
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
        return start, rank_environment(spec, self.port, rank, rank, spec.world_size), os.getcwd()

    def _start_rank(self, rank: int, start: protocol.RankStart, env: dict[str, str], cwd: str,
                    store_sock: socket.socket | None, template: "rank_template.Template | None") -> None:
        pass_fds = ()
        store_fd = store_sock.fileno() if rank == 0 and store_sock is not None else None
        proc = template.fork(start.to_json(), env, cwd, store_fd) if template is not None else None
        if proc is None:
            if store_fd is not None:
                os.set_inheritable(store_fd, True)
                pass_fds = (store_fd,)
                start = dataclasses.replace(start, store_fd=store_fd)
            proc = subprocess.Popen(
                rank_template.python_module_command("ddp_notebook.rank.worker"), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd, start_new_session=True,
                pass_fds=pass_fds,
            )
            proc.stdin.write(json.dumps(start.to_json()).encode())
            proc.stdin.close()
        self.procs.append(proc)
        self.pids[rank] = proc.pid
        for stream, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)):
            os.set_blocking(pipe.fileno(), False)
            self.pipes[pipe.fileno()] = (rank, stream)
