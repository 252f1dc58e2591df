"""Ranks as the tasks of a Slurm job, submitted with the user's submitit executor (``%%ddp --executor``).

The task is exported (:mod:`~ddp_notebook.engine.export`) into a staging folder
beside the executor's folder, on the filesystem submitit already needs the
compute nodes to share: the payload, the big arrays in a file that the ranks
memory-map, and a manifest of versions.  One Slurm task is one rank: each runs
:class:`~ddp_notebook.engine.slurm_task.RankCommand`, which starts
``python -m ddp_notebook.rank.slurm`` (the torchrun contract from Slurm's
environment, then the export); the last rank to load the task removes the
staging folder.

Two ways back.  The ranks connect to this kernel's channel when every one of
them can reach it: output, metrics, results and failures then flow as for
local ranks.  When any cannot (a firewalled login node), all of them report
through files in the job's folder instead (``<job id>_ddp_notebook/``: the
metrics of each node and a result file per rank, see ``rank/torchrun.py``),
which this backend reads as they grow.  Rank output comes from the tasks' log
files (submitit's ``<job id>_<task>_log.out/.err``) either way.  While the job
waits in the queue the backend says so (``SCHEDULER`` events); stopping it
cancels the job (``scancel``).
"""
from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from ..wire import protocol
from ..wire.channel import ChannelServer
from ..wire.errors import LaunchError
from . import export as exporting
from .backend import ChannelRanks
from .runfiles import RunFiles, message_of
from .slurm_task import RankCommand
from .spec import JobSpec

log = logging.getLogger("ddp_notebook")

HOST_ENV = "DDP_NOTEBOOK_HOST"  # this kernel's address as the compute nodes reach it (default: the host name)
CONNECT_TIMEOUT_S = 10.0  # a rank that cannot reach the channel by then reports through the files
QUEUE_POLL_S = 1.0
LOG_POLL_S = 0.25
GONE_WAIT_S = 15.0  # after scancel, how long to wait for the job to leave the queue
# While the ranks have not loaded the task, the kernel touches a file beside it: ranks that cannot reach the channel
# and find it older than this take the kernel for dead (killed while the job was queued) and do not run the cell.
HEARTBEAT_EVERY_S = 2.0
HEARTBEAT_STALE_S = 60.0
HEARTBEAT_FILE = "notebook-alive"
ALIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED",
                "SIGNALING", "STAGE_OUT"}
INSTALL = "pip install 'ddp_notebook[slurm]'"
_SUBMITIT_LINE = re.compile(rb"^submitit (DEBUG|INFO|WARNING|ERROR|CRITICAL) \(")


def _submitit():
    try:
        import submitit
    except ImportError:
        raise LaunchError(f"--executor runs the cell as a Slurm job through submitit, which is not installed in "
                          f"this kernel's Python: {INSTALL}") from None
    return submitit


def check_executor(executor: Any) -> tuple[int, int, bool]:
    """(nodes, tasks per node, GPUs asked for) of a submitit executor for Slurm, or refuse it."""
    submitit = _submitit()
    if not isinstance(executor, submitit.Executor):
        raise LaunchError(f"--executor takes a submitit executor, as made by submitit.AutoExecutor(folder=...), "
                          f"not {type(executor).__name__}")
    cluster = getattr(executor, "cluster", None) or ("slurm" if isinstance(executor, submitit.SlurmExecutor)
                                                     else type(executor).__name__)
    if cluster != "slurm":
        raise LaunchError(f"this submitit executor runs jobs on {cluster!r}, not on Slurm (is srun on this host's "
                          f"PATH?); --executor needs a Slurm one")
    params = executor.parameters
    nodes, tasks = int(params.get("nodes") or 1), int(params.get("ntasks_per_node") or 1)
    gpus = bool(params.get("gpus_per_node") or params.get("gpus_per_task") or "gpu" in str(params.get("gres", "")))
    return nodes, tasks, gpus


def slurm_spec(executor: Any, *, gpus: Any = None, cpus: int | None = None, backend: str | None = None,
               port: int | None = None, seed: int | None = None, timeout: float | None = None,
               nnodes: int = 1, output_ranks: set[int] | None = None) -> JobSpec:
    """The spec of a job whose ranks are the tasks of a Slurm job of ``executor``; refuses what Slurm decides."""
    given = [flag for flag, value in (("gpus", gpus), ("cpus", cpus), ("port", port)) if value is not None]
    if nnodes != 1:
        given.append("nnodes")
    if given:
        raise LaunchError(f"with an executor, Slurm gives the ranks their hosts, devices and port; drop "
                          f"{', '.join(given)} and set nodes, tasks_per_node and gpus_per_node with "
                          f"executor.update_parameters(...)")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
    nodes, tasks, has_gpus = check_executor(executor)
    spec = JobSpec(world_size=nodes * tasks, backend=backend or ("nccl" if has_gpus else "gloo"), seed=seed,
                   timeout=timeout, output_ranks=output_ranks, executor=executor)
    spec.chosen_backend = backend  # None: each rank picks nccl where it sees CUDA, else gloo
    return spec


def _staging_dir(executor: Any) -> str:
    """A new folder for the export beside the executor's folder (cut before its first %-pattern such as %j)."""
    folder = os.path.abspath(os.path.expanduser(str(executor.folder)))
    parts = folder.split(os.sep)
    cut = next((i for i, part in enumerate(parts) if "%" in part), len(parts))
    root = os.sep.join(parts[:cut]) or os.sep
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, f".ddp_notebook-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}")
    os.mkdir(path, 0o700)  # the payload may hold the channel's key
    return path


def queue_state(job_id: str) -> tuple[str, str] | None:
    """(state, reason) of a Slurm job from ``squeue``; ("GONE", "") once Slurm has forgotten it; None when
    squeue did not answer (a busy controller: ask again later)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    if out.returncode != 0:
        return ("GONE", "") if "Invalid job id" in out.stderr else None
    if not line:
        return "GONE", ""
    state, _, reason = line.partition("|")
    return state, "" if reason == "None" else reason


def cancel(job_id: str, wait: float = GONE_WAIT_S) -> bool:
    """``scancel`` the job and wait until it has left the queue; True once it has."""
    subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        state = queue_state(job_id)
        if state is not None and state[0] not in ALIVE_STATES:
            return True
        time.sleep(0.25)
    return False


class _LogTail:
    """New whole lines of one task's log file, without submitit's own lines."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self, final: bool = False) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return b""
        self.offset += len(data)
        data = self.partial + data
        end = len(data) if final else data.rfind(b"\n") + 1
        self.partial = data[end:]
        return b"".join(line for line in data[:end].splitlines(keepends=True) if not _SUBMITIT_LINE.match(line))


class SlurmRanks(ChannelRanks):
    """The ranks of one job as the tasks of a Slurm job (see the module's docstring)."""

    runs_own_task = True

    def __init__(self, spec: JobSpec, relay):
        super().__init__(spec, relay)
        self.executor = spec.executor
        self.job: Any = None  # submitit's Job
        self.job_id: str | None = None
        self.state, self.reason = "SUBMITTING", ""
        self.mode: str | None = None  # "channel" or "files", once the ranks have shown which
        self.staging: str | None = None
        self.run_dir: str | None = None  # where the ranks write when they report through files
        self.exported: exporting.Exported | None = None
        self.shipped: dict[str, int] = {}  # bytes of the pickled task and of the memory-mapped arrays file
        self.submitted_at: float | None = None
        self.task_id = 0
        self.address: tuple[str, int] | None = None
        self._files: RunFiles | None = None
        self._told_problems = 0
        self._written_where: dict[int, dict] = {}  # rank -> its newest HERE in the run files (the files mode)
        self._logs: dict[tuple[int, str], _LogTail] = {}
        self._next_queue_poll = 0.0
        self._next_log_poll = 0.0
        self._next_beat = float("inf")
        self._gone = False

    # -- start ---------------------------------------------------------------------------------
    def launch(self, task: Any, task_id: int) -> None:
        spec = self.spec
        self.task_id = task_id
        self.started_at = None  # the start-up bound counts from when Slurm runs the job, not from the queue
        self.channel = ChannelServer("0.0.0.0")
        self.address = (os.environ.get(HOST_ENV) or socket.gethostname(), self.channel.address[1])
        notebook = {"address": list(self.address), "key": self.channel.key.hex(), "task": task_id,
                    "job_dir": None, "files_if_unreachable": True, "connect_timeout": CONNECT_TIMEOUT_S,
                    "heartbeat": {"file": HEARTBEAT_FILE, "stale_after": HEARTBEAT_STALE_S}}
        self.staging = _staging_dir(self.executor)
        self._beat()
        self.exported = exporting.write(task, os.path.join(self.staging, "task.py"), seed=spec.seed,
                                        timeout=spec.timeout, backend=spec.chosen_backend, notebook=notebook,
                                        rank_options={"results_to_files": True, "remove_after_load": True})
        self.shipped = {"payload": os.path.getsize(self.exported.payload),
                        "arrays": os.path.getsize(self.exported.arrays) if self.exported.arrays else 0}
        self._submit()

    def _submit(self) -> None:
        try:
            self.job = self.executor.submit(RankCommand(self.exported.manifest))
        except Exception as exc:
            raise LaunchError(f"Slurm refused the job: {exc}") from None
        self.job_id = str(self.job.job_id)
        self.submitted_at = time.time()
        folder = str(self.job.paths.folder)
        self.run_dir = protocol.slurm_run_dir(folder, self.job_id)
        self._files = RunFiles(self.run_dir, key=self.channel.key)  # only records signed with this job's key
        for rank in range(self.spec.world_size):
            for stream, suffix in (("stdout", "out"), ("stderr", "err")):
                self._logs[(rank, stream)] = _LogTail(os.path.join(folder, f"{self.job_id}_{rank}_log.{suffix}"))
        log.debug("Slurm job %s submitted: %s ranks, logs in %s", self.job_id, self.spec.world_size, folder)
        print(f"ddp_notebook: Slurm job {self.job_id} submitted ({self.spec.world_size} ranks); its logs: {folder}",
              file=sys.stderr)

    # -- watch -----------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.1) -> None:
        super().pump(timeout)
        now = time.monotonic()
        if now >= self._next_beat:
            self._beat()
        if now >= self._next_log_poll:
            self._next_log_poll = now + LOG_POLL_S
            self._read_logs()
        if now >= self._next_queue_poll and not self._gone:
            self._next_queue_poll = now + QUEUE_POLL_S
            self._read_files()
            self._poll_queue()

    def _beat(self) -> None:
        """Tell ranks that have not loaded the task yet that this kernel is alive (see HEARTBEAT_STALE_S)."""
        self._next_beat = time.monotonic() + HEARTBEAT_EVERY_S
        path = os.path.join(self.staging, HEARTBEAT_FILE)
        try:
            with open(f"{path}.new", "w") as f:
                f.write(repr(time.time()))
            os.replace(f"{path}.new", path)
        except OSError:
            self._next_beat = float("inf")  # the ranks have loaded the task and removed the staging folder

    def _read_logs(self, final: bool = False) -> None:
        for (rank, stream), tail in self._logs.items():
            data = tail.read(final)
            if data:
                self.relay.feed(rank, stream, data)

    def _poll_queue(self) -> None:
        found = queue_state(self.job_id)
        if found is None:
            return
        state, reason = found
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason = state, reason
            if state == "RUNNING" and self.started_at is None:
                self.started_at = time.time()
            self._tell_scheduler()
        if state not in ALIVE_STATES:
            self._job_gone()

    def _tell_scheduler(self, **extra) -> None:
        self._on_message(-1, protocol.SCHEDULER, {
            "scheduler": "Slurm", "job": self.job_id, "state": self.state, "reason": self.reason,
            "since": self.submitted_at, "mode": self.mode, **extra})

    def _set_mode(self, mode: str, why: str) -> None:
        if self.mode is not None:
            return
        self.mode = mode
        print(f"ddp_notebook: Slurm job {self.job_id}: {why}", file=sys.stderr)
        self._tell_scheduler(why=why)

    def handle(self, rank: int, kind: str, body: dict) -> None:
        if kind == protocol.READY:
            self._set_mode("channel", f"the ranks report over this kernel's channel ({self.address[0]}:"
                                      f"{self.address[1]}, which the compute nodes reach)")
        elif kind == protocol.FILES:
            self._set_mode("files", f"{body['reason']} at {self.address[0]}:{self.address[1]}, so every rank "
                                    f"reports through files in {self.run_dir}, followed from here")
            return
        super().handle(rank, kind, body)

    def _read_files(self) -> None:
        """The ranks' records in the run folder, read until the ranks have shown they use the channel: from then on
        no file there is read (it could only be someone else's)."""
        if self._files is None or self.mode == "channel":
            return
        for record in self._files.new_records():
            event, rank = record.get("event"), record.get("rank", -1)
            if event == protocol.FILE_START:
                self._set_mode("files", f"no rank could reach this kernel at {self.address[0]}:{self.address[1]}, "
                                        f"so every rank reports through files in {self.run_dir}, followed from here")
                continue
            message = message_of(record)
            if message is not None:
                kind, rank, body = message
                if kind == protocol.READY:
                    self.ready.add(rank)
                self._on_message(rank, kind, {**body, "task": self.task_id})
            elif event == protocol.FILE_RESULT:
                value = self._files.result(record)
                if value is not None:
                    self._on_message(rank, protocol.RESULT, {"task": self.task_id, "value": value})
            elif event == protocol.HERE:
                self._written_where[rank] = record
            elif event == protocol.FILE_EXIT and rank not in self.exited:
                self.exited[rank] = None if record.get("lost") else 0
                self._on_exit(rank, self.exited[rank])
        for problem in self._files.problems[self._told_problems:]:
            print(f"ddp_notebook: Slurm job {self.job_id}: {problem}", file=sys.stderr)
        self._told_problems = len(self._files.problems)

    def where(self, ranks, wait: float, collectives: bool = True, stack: bool = True) -> dict[int, dict]:
        """Over the channel; in the files mode, what each rank wrote there last once its collectives stood still
        (``rank/collectives.tell_when_still``): no one can ask those ranks."""
        if self.mode != "files":
            return super().where(ranks, wait, collectives, stack)
        self._read_files()
        return {rank: self._written_where[rank] for rank in ranks if rank in self._written_where}

    def check_exits(self) -> None:
        """Ranks on the channel end with their connection (unless they went over to the files)."""
        for rank in self.lost_ranks():
            if self.mode != "files" and rank not in self.exited:
                self.exited[rank] = None
                self._on_exit(rank, None)

    def _job_gone(self) -> None:
        """Slurm is done with the job: what the ranks left is read, and every rank still counted has ended."""
        self._gone = True
        self.take_new_connections()
        for conn in list(self.connections):
            self.read_connection(conn)
        self._read_files()
        self._read_logs(final=True)
        for rank in range(self.spec.world_size):
            if rank not in self.exited:
                self.exited[rank] = None
                self._on_exit(rank, None)

    def describe_exit(self, rank: int, code: int | None) -> str:
        if code is not None:
            return super().describe_exit(rank, code)
        state = self.state if self._gone else "still running"
        how = f"ended with Slurm job {self.job_id} ({state})" if self._gone else \
            "lost its connection to the notebook (it, or its node, ended)"
        tail = self._log_tail(rank)
        return f"rank {rank} {how} without reporting an error" + (f"; its log ends:\n{tail}" if tail else "")

    def _log_tail(self, rank: int, lines: int = 12) -> str:
        text = []
        for stream in ("stdout", "stderr"):
            tail = self._logs.get((rank, stream))
            if tail is None:
                continue
            try:
                with open(tail.path, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - 8192))
                    text += [line for line in f.read().decode("utf-8", "replace").splitlines()
                             if not _SUBMITIT_LINE.match(line.encode())]
            except OSError:
                pass
        return "\n".join(f"  {line}" for line in text[-lines:])

    @property
    def alive(self) -> list[int]:
        return [] if self._gone else [r for r in range(self.spec.world_size) if r not in self.exited]

    # -- stop --------------------------------------------------------------------------------------
    def shut_down(self, wait: float = 10.0) -> None:
        """The job has succeeded: let Slurm see its tasks end, then clean up (cancelling what is left)."""
        deadline = time.monotonic() + wait
        while not self._gone and time.monotonic() < deadline:
            self.pump(0.1)
            self._next_queue_poll = min(self._next_queue_poll, time.monotonic() + 0.25)
        self.kill()

    def kill(self) -> None:
        if self.job_id is not None and not self._gone:
            self._read_logs()  # before the cancel: what Slurm writes after it is about being cancelled
            gone = cancel(self.job_id)
            self._gone = True
            if not gone:
                print(f"ddp_notebook: Slurm job {self.job_id} has not left the queue after scancel; check "
                      f"squeue -j {self.job_id}", file=sys.stderr)
        super().kill()
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None


@dataclass
class DetachedJob:
    """A Slurm job left running on its own (``--detach``): its ranks report through files in ``run_dir``,
    which ``ddp_notebook.follow(run_dir)`` (or the job's folder) shows from any kernel."""

    job_id: str
    folder: str  # submitit's folder of the job: logs, and the run directory
    run_dir: str
    world_size: int

    @property
    def state(self) -> str:
        found = queue_state(self.job_id)
        return found[0] if found is not None else "UNKNOWN"

    def cancel(self) -> None:
        """``scancel`` the job."""
        cancel(self.job_id)

    def __repr__(self) -> str:
        return (f"<Slurm job {self.job_id}: {self.world_size} ranks, {self.state}; "
                f"ddp_notebook.follow({self.folder!r}) shows it>")


def submit_detached(spec: JobSpec, task: Any) -> DetachedJob:
    """Submit the task as a Slurm job that reports through files only and needs no kernel; its handle."""
    staging = _staging_dir(spec.executor)
    try:
        exported = exporting.write(task, os.path.join(staging, "task.py"), seed=spec.seed, timeout=spec.timeout,
                                   backend=spec.chosen_backend,
                                   rank_options={"results_to_files": True, "remove_after_load": True})
        try:
            job = spec.executor.submit(RankCommand(exported.manifest))
        except Exception as exc:
            raise LaunchError(f"Slurm refused the job: {exc}") from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    folder = str(job.paths.folder)
    return DetachedJob(str(job.job_id), folder, protocol.slurm_run_dir(folder, str(job.job_id)), spec.world_size)
