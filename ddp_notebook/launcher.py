"""Start, watch and stop the ranks of a job.

One mechanism for the magic, ``launch``, ``spawn`` and warm pools: a
:class:`Job` runs one task on a :class:`~ddp_notebook.ranks.RankGroup` (its
own, started for it, or a pool's), collects the per-rank results, blames the
rank that failed first, and reports every event to its listeners.  It knows
nothing of dashboards: views subscribe with :meth:`Job.add_listener`.
"""
from __future__ import annotations

import errno
import itertools
import os
import pickle
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import gpus as gpu_discovery
from . import payload
from .errors import Failure, LaunchError, RankError, blame
from .output import OutputRelay
from .ranks import RankGroup

Listener = Callable[["Job", str, int, dict], None]

DEFAULT_CPU_RANKS = 2
# What chooses the devices of cells and launches that name none: the GPU picker. Explicit flags win, and a
# warm pool, which runs such cells itself, wins over it.
_default_devices: Callable[[], tuple[str, Any] | None] | None = None


def set_default_devices(fn: Callable[[], tuple[str, Any] | None] | None) -> None:
    """Install (or, with None, remove) what chooses the devices of cells and launches that name none.

    ``fn()`` returns ``("gpus", [indices])``, ``("cpus", n)`` or None (no opinion).
    """
    global _default_devices
    _default_devices = fn


_last_job: "Job | None" = None
# Called with each job as it starts, before its ranks: where views attach their listeners.
_job_observers: list[Callable[["Job"], None]] = []


def observe_jobs(observer: Callable[["Job"], None]) -> Callable[["Job"], None]:
    """Call ``observer(job)`` for every job from now on, as it starts (once per observer)."""
    if observer not in _job_observers:
        _job_observers.append(observer)
    return observer


@dataclass
class JobSpec:
    """Where and how the ranks run."""

    world_size: int
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES entries; None for CPU ranks
    backend: str = "gloo"
    port: int | None = None
    seed: int | None = None
    timeout: float | None = None  # per collective, passed to init_process_group
    startup_timeout: float = 120.0
    init_group: bool = True
    output_ranks: set[int] | None = None  # None: every rank's output
    master_addr: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # told to the user at start
    nnodes: int = 1  # > 1: this host is node 0 of a job on several hosts (nodes.py); world_size counts them all
    export_path: str | None = None  # the script the other hosts run under torchrun (nnodes > 1)


def _parse_gpu_arg(gpus: Any) -> int | list[int]:
    if isinstance(gpus, bool):
        raise LaunchError(f"gpus must be a count or a list of indices, not {gpus!r}")
    if isinstance(gpus, int):
        return gpus
    if isinstance(gpus, str):
        text = gpus.strip()
        if "," not in text:
            try:
                return int(text)
            except ValueError:
                raise LaunchError(f"--gpus {gpus!r}: give a count (2) or indices (0,2,5; one index is written 3,)") from None
        try:
            return [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise LaunchError(f"--gpus {gpus!r}: indices must be integers, as in 0,2,5") from None
    return [int(i) for i in gpus]


def resolve_devices(gpus: Any = None, cpus: int | None = None, backend: str | None = None) -> JobSpec:
    """Turn the user's device request into a spec, or refuse it before anything starts."""
    if gpus is not None and cpus is not None:
        raise LaunchError("give either gpus or cpus, not both")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
    notes: list[str] = []
    if gpus is None and cpus is None and _default_devices is not None:
        chosen = _default_devices()
        if chosen is not None:
            kind, value = chosen
            gpus, cpus = (value, None) if kind == "gpus" else (None, value)
            notes.append(f"using the {kind} chosen in the GPU picker: {value}")
    if cpus is not None:
        if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
            raise LaunchError(f"cpus must be a positive number of ranks, not {cpus!r}")
        if backend == "nccl":
            raise LaunchError("the nccl backend needs GPUs; CPU ranks use gloo")
        return JobSpec(world_size=cpus, backend="gloo", notes=notes)
    available = gpu_discovery.discover()
    if gpus is None:
        if not available:
            if backend == "nccl":
                raise LaunchError("the nccl backend needs GPUs, and this machine has none")
            return JobSpec(world_size=DEFAULT_CPU_RANKS, backend="gloo", notes=notes)
        chosen_gpus = available
    else:
        request = _parse_gpu_arg(gpus)
        if isinstance(request, int):
            if request < 1:
                raise LaunchError(f"gpus must be at least 1, not {request}")
            if request > len(available):
                raise LaunchError(f"{request} GPUs asked for, but this machine has {len(available)}: "
                                  f"{gpu_discovery.describe(available)}")
            chosen_gpus = sorted(gpu_discovery.least_busy(available, request), key=lambda g: g.index)
            if request < len(available):
                notes.append(f"using the {request} least busy GPUs: "
                             + ", ".join(f"{g.index} ({g.load_text()})" for g in chosen_gpus))
        else:
            if not request:
                raise LaunchError("--gpus: no GPU index given")
            if len(set(request)) != len(request):
                raise LaunchError(f"--gpus lists a GPU twice: {request}")
            by_index = {g.index: g for g in available}
            unknown = [i for i in request if i not in by_index]
            if unknown:
                raise LaunchError(f"GPU {', '.join(map(str, unknown))} not found; this machine has "
                                  f"{len(available)}: {gpu_discovery.describe(available)}")
            chosen_gpus = [by_index[i] for i in request]
    shared = [g for g in chosen_gpus if g.our_ranks]
    if shared:
        notes.append("already running a ddp_notebook job: "
                     + "; ".join(f"GPU {g.index}: {g.jobs_text()}" for g in shared))
    return JobSpec(world_size=len(chosen_gpus), gpus=[g.visible_id for g in chosen_gpus],
                   backend=backend or "nccl", notes=notes)


def check_options(port: Any = None, seed: Any = None, timeout: Any = None, startup_timeout: Any = None) -> None:
    """Refuse malformed job options before anything starts."""
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise LaunchError(f"port must be between 1 and 65535, not {port!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise LaunchError(f"seed must be a non-negative integer, not {seed!r}")
    for name, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise LaunchError(f"{name} must be a positive number of seconds, not {value!r}")


def _bind_port(addr: str, port: int | None) -> socket.socket:
    """A listening socket for rank 0's TCPStore: the port is never free for anyone else to take."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port or 0))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} is already in use on {addr}; pick another or leave --port out "
                              f"for a free one. No rank was started.") from None
        raise
    return sock


def _free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


_task_ids = itertools.count(1)


class EventSource:
    """What views need of a run: listeners for its events, its reduced ``history``, a way to redraw it."""

    listeners: list[Listener]

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(job, kind, rank, body)`` for every event a rank sends."""
        self.listeners.append(listener)

    def _emit(self, kind: str, rank: int, body: dict) -> None:
        for listener in list(self.listeners):
            listener(self, kind, rank, body)

    def show(self) -> None:
        """Draw the metrics dashboard again from the history (widgets in a notebook, text elsewhere)."""
        from . import dashboard  # notebook side, imported only when asked for

        dashboard.show(self)

    @property
    def done(self) -> bool:
        return self._outcome is not None


class Job(EventSource):
    """One task run on a group of ranks; ``result()`` waits for it and returns the per-rank values.

    A job starts its own ranks and ends them afterwards, or runs on the ranks
    of a warm pool (``group``), possibly on some of them only (``targets``).
    """

    def __init__(self, spec: JobSpec, task: Any, *, relay: OutputRelay | None = None, grace: float = 3.0,
                 group: RankGroup | None = None, targets: list[int] | None = None,
                 on_interrupt: Callable[["Job"], None] | None = None):
        self.spec = spec
        self.task = task
        self.relay = relay or OutputRelay(ranks=spec.output_ranks)
        self.grace = grace
        self.group = group
        self.targets = list(range(spec.world_size)) if targets is None else list(targets)
        self.on_interrupt = on_interrupt
        self.task_id = next(_task_ids)
        self.listeners: list[Listener] = []
        self.history: list[dict] = []  # reduced metric records, filled by an observer (dashboard.watch)
        self.callbacks: list[Any] = []  # each reduced metric record is sent to these (see callbacks.py)
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._owns_group = group is None
        self._task_path: str | None = None
        self._results: dict[int, Any] = {}
        self._failures: dict[int, Failure] = {}
        self._first_failure_at: float | None = None
        self._outcome: tuple[str, Any] | None = None  # ("ok", values) | ("error", exc)
        self._thread: threading.Thread | None = None
        self._finishing = False
        self._stop_requested = False
        self.on_done: list[Callable[["Job"], None]] = []  # called once the job has ended, on its thread

    @property
    def pids(self) -> dict[int, int]:
        return self.group.pids if self.group is not None else {}

    @property
    def port(self) -> int | None:
        return self.group.port if self.group is not None else None

    @property
    def workdir(self) -> str | None:
        return self.group.workdir if self.group is not None else None

    @property
    def status(self) -> str:
        """'running', 'done', 'failed' or 'stopped'."""
        if self._outcome is None or self.ended_at is None:
            return "running"
        kind, value = self._outcome
        return "done" if kind == "ok" else "stopped" if isinstance(value, KeyboardInterrupt) else "failed"

    @property
    def results(self) -> list[Any] | None:
        """The per-rank return values once the job has succeeded."""
        return self._outcome[1] if self._outcome is not None and self._outcome[0] == "ok" else None

    @property
    def error(self) -> BaseException | None:
        """The job's error once it has failed (or ``KeyboardInterrupt`` once stopped)."""
        return self._outcome[1] if self._outcome is not None and self._outcome[0] == "error" else None

    def __repr__(self) -> str:
        where = f"{self.spec.world_size} GPU ranks" if self.spec.gpus else f"{self.spec.world_size} CPU ranks"
        return f"<ddp_notebook Job #{self.task_id} on {where}: {self.status}>"

    # -- start -----------------------------------------------------------
    def start(self) -> "Job":
        global _last_job
        _last_job = self
        spec = self.spec
        self.started_at = time.time()
        for observe in list(_job_observers):
            observe(self)
        if self._owns_group and spec.nnodes > 1:
            from .nodes import NodeGroup  # several hosts: this host's ranks under a torchrun agent

            self.group = NodeGroup(spec, self.relay, self.task, self.task_id).start()
        elif self._owns_group:
            self.group = RankGroup(spec, self.relay)
            store_sock = None
            try:
                if spec.init_group:
                    store_sock = _bind_port(spec.master_addr, spec.port)
                    self.group.port = store_sock.getsockname()[1]
                else:
                    self.group.port = spec.port or _free_port(spec.master_addr)
                self.group.start(store_sock)
            finally:
                if store_sock is not None:
                    store_sock.close()  # rank 0 holds its own copy
        if not self._owns_group:
            self.group.relay = self.relay
        self.group.handler = self._on_message
        self.group.on_exit = self._on_exit
        if spec.nnodes == 1:  # (on several hosts every rank runs the task exported with it)
            self._send_task()
        self._emit("started", -1, {"world_size": spec.world_size, "port": self.port, "pids": dict(self.pids)})
        return self

    def _send_task(self) -> None:
        try:
            self._task_path = payload.write(self.task, self.group.workdir, f"task-{self.task_id}.pkl")
        except BaseException:
            if self._owns_group:
                self.group.kill()
            raise
        for rank in self.targets:
            self.group.send(rank, ("run", {"task": self.task_id, "path": self._task_path, "seed": self.spec.seed}))

    # -- watch -----------------------------------------------------------
    def _pump(self, timeout: float = 0.1) -> None:
        self.group.pump(timeout)
        self._check_progress()

    def _on_message(self, rank: int, kind: str, body: dict) -> None:
        if body.get("task", self.task_id) != self.task_id:
            return  # a late word about an earlier cell of a warm pool
        if kind == "result" and rank in self.targets:
            try:
                self._results[rank] = pickle.loads(body["value"])
            except Exception as exc:
                self._add_failure(Failure(rank, type(exc).__name__, f"its return value could not be unpickled "
                                          f"in the notebook: {exc}", "", time.time(), "user"))
        elif kind == "failed":
            self._add_failure(Failure(rank, body["etype"], body["message"], body["traceback"], body["time"],
                                      body["kind"]))
        self._emit(kind, rank, body)

    def _on_exit(self, rank: int, code: int | None) -> None:
        if rank not in self._results and rank not in self._failures and self._outcome is None \
                and not self._finishing:
            if code is None:  # a rank on another host: only its connection tells
                how = "lost its connection to the notebook (it, its torchrun agent or its host ended)"
            else:
                how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
            if code in (-signal.SIGABRT, 134):
                how += " (abort or crash)"
            elif code == -signal.SIGSEGV:
                how += " (segmentation fault)"
            self._add_failure(Failure(rank, "RankDied", f"rank {rank} {how} without reporting an error",
                                      "", time.time(), "exit"))
        self._emit("exited", rank, {"code": code})

    def _add_failure(self, failure: Failure) -> None:
        if failure.rank in self._failures:
            return
        self._failures[failure.rank] = failure
        if self._first_failure_at is None:
            self._first_failure_at = time.monotonic()

    def _check_progress(self) -> None:
        spec = self.spec
        targets = self.targets
        if self._failures:
            answered = set(self._results) | set(self._failures) | set(self.group.exited)
            # A real error needs no wait; a crash barely any; a lost peer may be
            # the echo of an error whose report is still on its way.
            kinds = {f.kind for f in self._failures.values()}
            wait = 0.3 if kinds & {"user", "startup"} else 0.5 if "exit" in kinds else self.grace
            if answered >= set(targets) or time.monotonic() - self._first_failure_at >= wait:
                self._fail()
            return
        if len(self._results) == len(targets):
            self._outcome = ("ok", [self._results[r] for r in targets])
            return
        group = self.group
        if spec.init_group and len(group.ready) + len(group.exited) < spec.world_size \
                and time.time() - group.started_at > spec.startup_timeout:
            late = sorted(set(range(spec.world_size)) - group.ready)
            self._add_failure(Failure(late[0], "StartupTimeout",
                                      f"ranks {', '.join(map(str, late))} did not join the process group within "
                                      f"{spec.startup_timeout:.0f} s (start-up bound, not --timeout)",
                                      "", time.time(), "startup"))

    def _fail(self) -> None:
        failures = sorted(self._failures.values(), key=lambda f: f.rank)
        cause = blame(failures)
        note = ""
        timed_out = [f.rank for f in failures if f.kind == "timeout"]
        if cause.kind == "timeout":
            finished = sorted(self._results)
            note = f"ranks {', '.join(map(str, timed_out))} were stuck in a collective until the timeout " \
                   f"({self.spec.timeout} s)"
            if finished:
                note += f"; rank(s) {', '.join(map(str, finished))} finished the cell without joining it"
            elif len(timed_out) < len(self.targets):
                stuck_elsewhere = sorted(set(self.targets) - set(timed_out))
                note += f"; rank(s) {', '.join(map(str, stuck_elsewhere))} were elsewhere"
        others = [f.rank for f in failures if f.rank != cause.rank]
        if len(failures) == len(self.targets) > 1 and len({f.headline() for f in failures}) == 1:
            note = "(every rank failed the same way)"
        elif others and cause.kind != "timeout":
            note = f"(rank(s) {', '.join(map(str, others))} failed after it, as a consequence)"
        self._outcome = ("error", RankError(cause, failures, note))

    # -- wait / stop -----------------------------------------------------
    def result(self) -> list[Any]:
        """Wait for the job; the per-rank return values, or raise the first rank's error."""
        return self.wait()

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Wait (at most ``timeout`` seconds for a background job); what the foreground run would return."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"job #{self.task_id} is still running after {timeout} s")
        else:
            self._run()
        kind, value = self._outcome
        if kind == "error":
            raise value
        return value

    def _run(self) -> None:
        try:
            while self._outcome is None:
                if self._stop_requested:
                    raise KeyboardInterrupt
                self._pump()
        except BaseException:
            self._stop_now()
            raise
        self._finish()

    def run_in_background(self) -> "Job":
        self._thread = threading.Thread(target=self._run_quietly, name="ddp-job", daemon=True)
        self._thread.start()
        return self

    def _run_quietly(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001
            if self._outcome is None:
                self._outcome = ("error", exc)

    def _finish(self) -> None:
        """Let ranks exit cleanly on success; stop them at once on failure."""
        self._finishing = True
        if self._owns_group:
            if self._outcome[0] == "ok":
                self.group.shut_down()
            else:
                self.group.kill()
        self._end()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the job: its own ranks are ended; on a warm pool the pool brings its ranks back."""
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            self._stop_requested = True  # the job's own thread stops it: it owns the ranks' pipes
            thread.join(timeout)
            return
        if self.ended_at is None:
            self._stop_now()

    def _stop_now(self) -> None:
        self._finishing = True
        if self._outcome is None:
            self._outcome = ("error", KeyboardInterrupt())
        if self._owns_group:
            if self.group is not None:
                self.group.kill()
        elif self.on_interrupt is not None:
            self.on_interrupt(self)
        self._end()

    def _end(self) -> None:
        if self._task_path is not None:
            try:
                os.unlink(self._task_path)
            except OSError:
                pass
            self._task_path = None
        payload.release(self.task)  # its shared arrays: the ranks have mapped them or are gone
        if self.ended_at is None:
            self.ended_at = time.time()
            self.relay.flush(final=True)
            self._emit("ended", -1, {"ok": self._outcome[0] == "ok"})
            for callback in self.on_done:
                callback(self)


def last_job() -> Job | None:
    """The most recently started job."""
    return _last_job


def launch(fn: Callable, args: tuple = (), kwargs: dict | None = None, *, gpus: Any = None, cpus: int | None = None,
           port: int | None = None, seed: int | None = None, backend: str | None = None,
           timeout: float | None = None, callbacks: list | tuple = (), background: bool = False,
           nnodes: int = 1, master_addr: str | None = None, export: str | None = None) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank with the process group ready; the per-rank return values.

    With no devices named, a warm pool (``%ddp_start``) runs it if one is up.
    ``callbacks`` get each metric record the ranks ``report()``, reduced over
    all ranks, in this process.  ``background=True`` returns the running
    :class:`Job` at once (``job.wait()`` gives the values).

    ``nnodes > 1``: this host runs node 0 (the devices named here) of a job on
    that many hosts, with the master at ``master_addr:port``; the call is
    exported to the script ``export`` (default ``ddp_node_job.py``), which the
    other hosts run with torchrun (the command is printed).
    """
    check_options(port, seed, timeout)
    pool = _pool() if gpus is None and cpus is None and nnodes == 1 else None
    if pool is not None:
        pool.refuse_job_options(port=port, timeout=timeout, backend=backend)
    spec = pool.spec_for(seed) if pool is not None else resolve_devices(gpus, cpus, backend)
    if pool is None:
        spec.port, spec.seed, spec.timeout = port, seed, timeout
    if nnodes != 1:
        from .nodes import node_spec

        spec = node_spec(spec, nnodes, 0, master_addr, export)
    task = payload.CallTask(fn, tuple(args), dict(kwargs or {}), False, _sources_for(fn))
    job = start_job(prepare_job(spec, task, callbacks, on_pool=pool is not None))
    return job.run_in_background() if background else job.result()


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> Any:
    """Drop-in for ``torch.multiprocessing.spawn`` that accepts notebook-defined functions.

    Calls ``fn(rank, *args)`` in ``nprocs`` processes; the user's code sets up
    the process group (MASTER_ADDR/MASTER_PORT are preset to a free port).
    Returns the per-rank return values, or with ``join=False`` a handle whose
    ``join()`` waits (``daemon`` and ``start_method`` are accepted and ignored).
    """
    spec = JobSpec(world_size=nprocs, backend="gloo", init_group=False)
    gpu_list = gpu_discovery.discover()
    if gpu_list:
        # As under mp.spawn, every process sees every GPU and picks its own.
        spec.gpus = [g.visible_id for g in gpu_list]
    task = payload.CallTask(fn, tuple(args), {}, True, _sources_for(fn))
    if join:
        return run_job(spec, task)
    return SpawnContext(start_job(Job(spec, payload.dumps(task))).run_in_background())


class SpawnContext:
    """What ``spawn(..., join=False)`` returns, like ``mp.spawn``'s ProcessContext."""

    def __init__(self, job: Job):
        self.job = job
        self.pids = lambda: [job.pids[r] for r in sorted(job.pids)]

    def join(self, timeout: float | None = None) -> bool:
        """True once every process has finished; raises the first rank's error."""
        self.job._thread.join(timeout)
        if not self.job.done or self.job._thread.is_alive():
            return False
        self.job.result()
        return True

    def result(self) -> list[Any]:
        return self.job.result()


def _sources_for(fn: Callable) -> payload.Sources:
    code = getattr(fn, "__code__", None)
    return payload.notebook_sources({code.co_filename} if code else set())


def prepare_job(spec: JobSpec, task: Any, callbacks: list | tuple = (), *, on_pool: bool = True,
                relay: OutputRelay | None = None, targets: list[int] | None = None) -> Job:
    """A job for the task, not started yet: on the warm pool when there is one and ``on_pool`` allows."""
    pool = _pool() if on_pool else None
    data = task if spec.nnodes > 1 else payload.dumps(task)  # several hosts: exported when the job starts
    job = pool.job(data, spec, targets, relay) if pool is not None else Job(spec, data, relay=relay)
    job.callbacks = list(callbacks)
    for note in spec.notes:
        print(f"ddp_notebook: {note}", file=sys.stderr)
    return job


def start_job(job: Job) -> Job:
    try:
        return job.start()
    except BaseException:
        payload.release(job.task)  # no rank ever ran: its shared arrays go now
        raise


def run_job(spec: JobSpec, task: Any, callbacks: list | tuple = ()) -> list[Any]:
    """Run the task as a fresh job and wait for its per-rank values."""
    return start_job(prepare_job(spec, task, callbacks, on_pool=False)).result()


def _pool():
    from . import pool  # the warm pool runs jobs over this module's Job: imported when asked for

    return pool.current()
