"""The front door: ``launch()``, ``spawn()`` and what the magic shares with them.

Chooses where a task runs (the warm pool, fresh ranks, or this host as node 0
of several), pickles it once and hands it to a :class:`~ddp_notebook.engine.job.Job`.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable

from .engine import devices as gpu_discovery
from .engine import multinode, pool, profiling, slurm
from .engine import template as rank_template
from .engine.local import LocalRanks
from .engine.callbacks import resolve_all as resolve_callbacks
from .engine.job import Job, JobOptions, background_jobs, last_job, observe_jobs  # noqa: F401 (the package API)
from .engine.output import OutputRelay, RankLogs
from .engine.spec import JobSpec, call_arguments, check_options, check_together, resolve_devices
from .notebook import ipython_cells, profile_view, prompting
from .wire import payload
from .wire.errors import LaunchError, Stopped

ipython_cells.install()  # tracebacks show the notebook's cells as written


def launch(fn: Callable, args: tuple = (), kwargs: dict | None = None, *, gpus: Any = None, cpus: int | None = None,
           port: int | None = None, seed: int | None = None, backend: str | None = None,
           timeout: float | None = None, callbacks: list | tuple = (), background: bool = False,
           nnodes: int = 1, master_addr: str | None = None, export: str | None = None, executor: Any = None,
           detach: bool = False, max_restarts: int = 0, log_dir: str | None = None, force: bool = False,
           wait: float | None = None, debug: bool = False, profile: Any = None,
           hang_after: float | None = 180.0) -> Any:
    """Run ``fn(*args, **kwargs)`` on every rank with the process group ready; the per-rank return values.

    With no devices named, a warm pool (``%ddp_start``) runs it if one is up.
    ``callbacks`` get each metric record the ranks ``report()``, reduced over
    all ranks, in this process.  ``background=True`` returns the running
    :class:`Job` at once (``job.wait()`` gives the values).

    ``nnodes > 1``: this host runs node 0 (the devices named here) of a job on
    that many hosts, with the master at ``master_addr:port``; the call is
    exported to the script ``export`` (default ``ddp_node_job.py``), which the
    other hosts run with torchrun (the command is printed).

    ``executor`` (a submitit executor for Slurm): the ranks are the tasks of a
    Slurm job with its parameters (nodes × tasks per node ranks).  With
    ``detach=True`` the job is left to run on its own and its handle returned
    at once; ``ddp_notebook.follow(handle.folder)`` shows it from any kernel.

    ``max_restarts=N``: when a rank fails, every rank is stopped and ``fn`` runs again on fresh ranks, up to N
    times (``ddp_notebook.attempt()`` and ``ddp_notebook.resume()`` in the ranks).  ``log_dir``: every rank's
    complete output also goes to ``log_dir/rank<N>.log`` (``job.logs(rank)`` keeps the newest 16 MB in memory).

    GPUs are reserved for the job against every other ddp_notebook job on the machine.  ``gpus=N, wait=M`` waits
    up to M minutes (``math.inf``: no limit) for N GPUs free of reservations and load; ``force=True`` shares GPUs
    named by index that another job holds.

    ``input()``, ``breakpoint()`` and pdb in a rank ask in the notebook (its input box), one rank at a time.
    ``debug=True``: the first failing rank stays at its failure (the others are stopped); ``%ddp_debug`` (or
    ``ddp_notebook.last_job().debug()``) then opens the debugger there.

    ``profile=True`` (or ``"steps=20,skip=5"``): every rank runs torch.profiler over a window of its steps; one
    merged trace goes to ``log_dir`` (else the working folder) and ``last_job().profile`` says where each rank's
    time went (docs/metrics-and-dashboard.md).
    ``hang_after``: after that many seconds without progress (no report, batch, completed collective or result)
    the job says why it is stuck (``job.why()``: which ranks wait in which collective, which rank has not joined
    it and where it is) and goes on; 0 or None: never.
    """
    args, kwargs = call_arguments("launch", args, kwargs)
    check_options(port, seed, timeout, max_restarts=max_restarts, nnodes=nnodes, hang_after=hang_after,
                  log_dir=log_dir)
    callbacks = resolve_callbacks(callbacks)  # a logger that cannot log is refused now
    check_together(debug=debug, detach=detach, executor=executor, nnodes=nnodes,
                   flag=lambda name: f"{name}=True" if name in ("debug", "detach") else f"{name}=")
    profile = profiling.checked(profile, nnodes=nnodes, executor=executor, detach=detach)
    warm = warm_pool_for(gpus, cpus, nnodes, executor=executor)
    spec = plan(warm, gpus=gpus, cpus=cpus, backend=backend, port=port, seed=seed, timeout=timeout, nnodes=nnodes,
                master_addr=master_addr, export=export, executor=executor, force=force, wait=wait)
    try:
        task = payload.CallTask(fn, args, kwargs, False, payload.sources_for(fn))
        if detach:
            return submit_detached(spec, task)
        options = JobOptions(max_restarts=max_restarts, hang_after=hang_after or None, keep_failed_rank=debug,
                             callbacks=tuple(callbacks), profile=profile, profile_folder=log_dir,
                             # input() and pdb in a rank ask here, in the foreground
                             prompter=None if background else prompting.ask_in_notebook)
        job = prepare_job(spec, task, options, on_pool=warm is not None, background=background, log_dir=log_dir)
    except BaseException:  # (an interrupt too): the job will not run, and its GPUs go back now
        spec.release_devices()
        raise
    start_job(job, background=background)
    if background:
        return job.run_in_background()
    try:
        return foreground_result(job)
    finally:
        profile_view.show(job)


def warm_pool_for(gpus: Any = None, cpus: int | None = None, nnodes: int = 1,
                  export_only: bool = False, executor: Any = None) -> pool.Pool | None:
    """The warm pool that runs a job asking for these devices: the running one when none are named, on one host,
    for a run (an export only writes files, an executor's job runs on Slurm); else None."""
    if gpus is None and cpus is None and nnodes == 1 and not export_only and executor is None:
        return pool.current()
    return None


def plan(warm: pool.Pool | None, *, gpus: Any = None, cpus: int | None = None, backend: str | None = None,
         port: int | None = None, seed: int | None = None, timeout: float | None = None, nnodes: int = 1,
         node_rank: int | None = 0, master_addr: str | None = None, export: str | None = None,
         output_ranks: set[int] | None = None, executor: Any = None, force: bool = False,
         wait: float | None = None) -> JobSpec:
    """Where and how a job runs: on ``warm`` (the warm pool, which refuses options it cannot honour), on fresh
    ranks of the devices asked for, with ``nnodes > 1`` as node 0 of several hosts, or with ``executor`` as the
    tasks of a Slurm job.  Refuses with LaunchError before anything starts; shared by ``%%ddp`` and
    :func:`launch`."""
    if executor is not None:
        return slurm.slurm_spec(executor, gpus=gpus, cpus=cpus, backend=backend, port=port, seed=seed,
                                timeout=timeout, nnodes=nnodes, output_ranks=output_ranks)
    if warm is not None:
        warm.refuse_job_options(port=port, timeout=timeout, backend=backend)
        return warm.spec_for(seed, output_ranks)
    spec = resolve_devices(gpus, cpus, backend, force=force, wait=wait, port=port, seed=seed, timeout=timeout,
                           output_ranks=output_ranks)
    if nnodes != 1:
        spec = multinode.node_spec(spec, nnodes, node_rank, master_addr, export)
    return spec


def submit_detached(spec: JobSpec, task: Any) -> slurm.DetachedJob:
    """Submit the task as a Slurm job of ``spec.executor`` that runs on its own (``--detach``); its handle."""
    return slurm.submit_detached(spec, task)


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True, daemon: bool = False,
          start_method: str = "spawn") -> Any:
    """Drop-in for ``torch.multiprocessing.spawn`` that accepts notebook-defined functions.

    Calls ``fn(rank, *args)`` in ``nprocs`` processes; the user's code sets up
    the process group (MASTER_ADDR/MASTER_PORT are preset to a free port).
    Returns the per-rank return values, or with ``join=False`` a handle whose
    ``join()`` waits (``daemon`` and ``start_method`` are accepted and ignored).
    """
    args, _ = call_arguments("spawn", args)
    if type(nprocs) is not int or nprocs < 1:
        raise LaunchError(f"spawn(nprocs=...) is the number of processes, a positive integer, not {nprocs!r}")
    # As under mp.spawn, every process sees every GPU and picks its own.
    spec = JobSpec(world_size=nprocs, gpus=[g.visible_id for g in gpu_discovery.discover()] or None, backend="gloo",
                   init_group=False)
    task = payload.CallTask(fn, args, {}, True, payload.sources_for(fn))
    if join:
        return run_job(spec, task)
    return SpawnContext(start_job(prepare_job(spec, task, on_pool=False, background=True),
                                  background=True).run_in_background())


class SpawnContext:
    """What ``spawn(..., join=False)`` returns, like ``mp.spawn``'s ProcessContext."""

    def __init__(self, job: Job):
        self.job = job

    def pids(self) -> list[int]:
        """The processes' pids, by rank (waited for while they are forked from a rank template that was still
        importing as spawn() returned)."""
        job = self.job
        while len(job.pids) < job.spec.world_size and not job.done:  # (a start that fails ends the job)
            time.sleep(0.01)
        return [job.pids[r] for r in sorted(job.pids)]

    def join(self, timeout: float | None = None) -> bool:
        """True once every process has finished; raises the first rank's error."""
        if not self.job.join(timeout):
            return False
        self.job.result()
        return True

    def result(self) -> list[Any]:
        return self.job.result()


def prepare_job(spec: JobSpec, task: Any, options: JobOptions = JobOptions(), *, on_pool: bool = True,
                relay: OutputRelay | None = None, targets: list[int] | None = None, background: bool = False,
                log_dir: str | None = None) -> Job:
    """A job for the task, not started yet: on the warm pool when there is one and ``on_pool`` allows.  The one
    place a job is made for the front doors (``%%ddp``, :func:`launch`, :func:`spawn`).

    ``background``: the notebook goes on working while the job runs, so the ranks get a snapshot of its big
    arrays (copied) rather than the notebook's own pages (moved, which only a waiting notebook allows).
    """
    warm = pool.current() if on_pool else None
    logs = data = None
    try:
        # This host's ranks' logs are opened (or refused) before any rank starts; others' when they first print.
        logs = None if log_dir is None else \
            RankLogs.open(log_dir, targets if targets is not None else range(spec.world_size // max(spec.nnodes, 1)))
        # several hosts, or a Slurm job: exported when the job starts
        data = task if spec.nnodes > 1 or spec.executor is not None else payload.dumps(task, snapshot=background)
        if warm is not None:
            job = warm.job(data, spec, options, targets, relay)
        else:  # fresh ranks: of this host, of this host as node 0 of several hosts, or of a Slurm job
            backend = slurm.SlurmRanks if spec.executor is not None else \
                multinode.TorchrunNode if spec.nnodes > 1 else LocalRanks
            job = Job(spec, data, options, relay=relay, backend=backend)
    except BaseException:
        if data is not None:
            payload.release(data)
        spec.release_devices()
        if logs is not None:
            logs.close()
        raise
    job.relay.log_to(logs)
    for note in spec.notes:
        print(f"ddp_notebook: {note}", file=sys.stderr)
    return job


def start_job(job: Job, background: bool = False) -> Job:
    """Start a prepared job; if it cannot start, its shared arrays are let go at once.  ``background``: the caller
    returns at once, so the job never waits here for a rank template that is not ready: its own thread forks the
    ranks from it once it is (:meth:`~ddp_notebook.engine.backend.RankBackend.finish_start`)."""
    try:
        if background:
            with rank_template.not_waiting():
                return job.start()
        return job.start()
    except BaseException:
        payload.release(job.task)  # no rank ever ran: its shared arrays go now
        job.spec.release_devices()
        job.relay.close_logs()
        raise


def run_job(spec: JobSpec, task: Any, callbacks: list | tuple = ()) -> list[Any]:
    """Run the task as a fresh job and wait for its per-rank values."""
    return foreground_result(start_job(prepare_job(spec, task, JobOptions(callbacks=tuple(callbacks)),
                                                   on_pool=False)))


def foreground_result(job: Job) -> list[Any]:
    """Wait for a job run in the foreground; its per-rank values.  Stopped gracefully, it raises :class:`Stopped`
    with the values, as an interrupted cell fails, so that "Run All" does not go on past it."""
    results = job.result()
    if job.stopped_text:
        raise Stopped(f"job #{job.task_id} {job.stopped_text}", "; its per-rank values are this exception's "
                      ".results (and ddp_notebook.last_job().wait())", results)
    return results

