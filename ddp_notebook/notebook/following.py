"""Show a job the notebook did not start: ``follow(run_dir)`` reads the metrics files of an exported script.

Each node of a torchrun job writes ``metrics-node<I>.jsonl`` in the run
directory (:mod:`ddp_notebook.runner`).  ``follow`` tails those files a few
times a second and feeds their events to the same reduction and dashboard as a
job's ranks feed them (:func:`ddp_notebook.dashboard.watch`), through a
:class:`FollowedRun` that looks like a job to them: ``run.history``,
``run.show()``, ``run.status``.  It ends when every node has written its end
line, shortly after a failure (once the files are quiet), at ``timeout``, or
when interrupted; the run itself goes on regardless.  Notebook side.
"""
from __future__ import annotations

import glob
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..wire import protocol
from . import dashboard
from ..wire.errors import Failure, FailureKind, RankError, blame
from ..engine import hangs
from ..engine.callbacks import as_list as callbacks_list
from ..engine.spec import check_options
from ..engine.job import EventSource
from ..engine.runfiles import RunFiles, UntrustedRunFolder, message_of
from ..wire.protocol import METRICS_PREFIX, METRICS_SUFFIX, SLURM_RUN_SUFFIX

POLL_S = 0.25
QUIET_AFTER_FAILURE_S = 5.0  # a failed run's nodes may not write their end: the files' silence ends it

Listener = Callable[[Any, str, int, dict], None]


@dataclass
class RunSpec:
    world_size: int
    nnodes: int


class _Written:
    """What the ranks of a followed run wrote of where they are, as ``hangs.diagnose`` asks a backend for it."""

    workdir = None  # (no folder of the notebook's: nothing to signal, no FIFO)
    pids: dict = {}

    def __init__(self, run: "FollowedRun"):
        self.alive = [r for r in range(run.spec.world_size) if r not in run.exited]
        self._told = run.told_where

    def where(self, ranks, wait: float, collectives: bool = True, stack: bool = True) -> dict[int, dict]:
        return {rank: self._told[rank] for rank in ranks if rank in self._told}


class FollowedRun(EventSource):
    """A torchrun job seen through its metrics files; what a Job is to the dashboard."""

    def __init__(self, run_dir: str, callbacks: list | tuple = (), hang_after: float | None = None):
        self.run_dir = run_dir
        self.run_id: str | None = None
        self.spec = RunSpec(0, 0)
        self.callbacks = tuple(callbacks_list(callbacks))  # given to its metrics once the run is found
        self.listeners: list[Listener] = []
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.nodes_started: set[int] = set()
        self.nodes_ended: dict[int, bool] = {}  # node -> its ranks all finished without error
        self.failures: dict[int, Failure] = {}
        self._outcome: tuple[str, Any] | None = None
        self._files = RunFiles(run_dir)  # the folder opened once, its files read through it
        self._told_problems = 0
        self._last_line_at = time.monotonic()
        self.exited: set[int] = set()
        self.told_where: dict[int, dict] = {}  # rank -> the newest HERE it wrote (why())
        self.hang_watch = hangs.HangWatch(hang_after)
        dashboard.install()  # show() draws with the dashboard, however the notebook side was reached

    @property
    def status(self) -> str:
        """'waiting' (no run yet), 'running' (still running), 'stopped' (following was stopped), 'done' or 'failed'."""
        if self.run_id is None:
            return "waiting"
        if self._outcome is not None and isinstance(self._outcome[1], KeyboardInterrupt):
            return "stopped"  # following was stopped
        if self.finished:
            return "failed" if self.failures or not all(self.nodes_ended.values()) else "done"
        return "failed" if self.failures else "running"

    @property
    def done(self) -> bool:
        """Following has ended."""
        return self._outcome is not None

    @property
    def finished(self) -> bool:
        """Every node of the run has written its end."""
        return self.spec.nnodes > 0 and len(self.nodes_ended) >= self.spec.nnodes

    @property
    def error(self) -> RankError | None:
        if not self.failures:
            return None
        failures = sorted(self.failures.values(), key=lambda f: f.rank)
        return RankError(blame(failures), failures)

    def __repr__(self) -> str:
        where = f"{self.spec.world_size} ranks on {self.spec.nnodes} nodes" if self.run_id else "no run yet"
        return f"<ddp_notebook run {self.run_id or ''} in {self.run_dir}, {where}: {self.status}>"

    # -- reading -----------------------------------------------------------------------------
    def poll(self) -> int:
        """Read what the files gained; the number of this run's lines taken.  Raises PermissionError for a run
        folder another user owns or may write in (what they wrote there would be shown as the run's)."""
        try:
            records = self._files.new_records()  # (none while the folder is not made yet)
        except UntrustedRunFolder as exc:
            raise PermissionError(f"follow(): {exc}: its files are not read; follow a run folder of yours "
                                  f"(the export's --run-dir) that only you may write in, or a copy of it") from None
        for problem in self._files.problems[self._told_problems:]:
            print(f"ddp_notebook: follow(): {problem}", file=sys.stderr)
        self._told_problems = len(self._files.problems)
        if self.run_id is None:
            starts = [r for r in records if r.get("event") == protocol.FILE_START]
            if not starts:
                return 0
            newest = max(starts, key=lambda r: r["time"])
            self.run_id = newest["run"]
            self.spec = RunSpec(newest["world_size"], newest["nnodes"])
            self.started_at = min(r["time"] for r in starts if r["run"] == self.run_id)
            self.start_metrics(self.spec.world_size, self.callbacks)  # its metrics, as every job has
            dashboard.watch(self)  # and a watcher, as every job gets
        taken = 0
        for record in records:
            if record.get("run") == self.run_id:
                self._take(record)
                taken += 1
                if record.get("event") != protocol.HERE:
                    self.hang_watch.progress()  # (a rank telling where it is stuck is no progress)
        if taken:
            self._last_line_at = time.monotonic()
        return taken

    def why(self) -> hangs.Diagnosis:
        """Why the run is stuck, from what its ranks wrote: a rank whose collectives stood still for 10 s
        (``DDP_NOTEBOOK_STILL_AFTER_S`` in the ranks' environment) writes its collectives and its stack to the
        run files; the newest of each rank is read as ``job.why()`` reads a rank's answer."""
        still_after = os.environ.get(protocol.STILL_AFTER_ENV, "10")
        return hangs.diagnose(_Written(self), list(range(self.spec.world_size)), sorted(self.exited), wait=0,
                              no_answer=f"no `here` line in the run files yet: a rank writes one once its "
                                        f"collectives stood still for {still_after} s")

    def _take(self, record: dict) -> None:
        event, rank = record.get("event"), record.get("rank", -1)
        message = message_of(record)
        if event == protocol.FAILED and rank not in self.failures:
            self.failures[rank] = Failure(rank, record["etype"], record["message"], record["traceback"],
                                          record["time"], record["kind"])
        if message is not None:
            self.emit(*message)
        elif event == protocol.FILE_START:
            self.nodes_started.add(record["node"])
        elif event == protocol.HERE:
            self.told_where[rank] = record
        elif event == protocol.FILE_EXIT:
            self.exited.add(rank)
            if record.get("lost") and rank not in self.failures:
                self.failures[rank] = Failure(rank, "RankDied", f"rank {rank} ended without reporting an error",
                                              "", record["time"], FailureKind.EXIT)
            self.emit(protocol.EXITED, rank, {"code": None if record.get("lost") else 0})
        elif event == protocol.FILE_END:
            self.nodes_ended[record["node"]] = bool(record["ok"])
            self.ended_at = max(self.ended_at or 0.0, record["time"])

    def close_files(self) -> None:
        """Let go of the run folder (a later :meth:`poll` opens it again)."""
        self._files.close()

    def quiet_for(self) -> float:
        return time.monotonic() - self._last_line_at

    def end(self, stopped: bool = False) -> None:
        """Following is over: release what the reduction holds back and close the views."""
        if self._outcome is not None or self.run_id is None:
            return
        ok = self.finished and not self.failures and all(self.nodes_ended.values())
        if stopped and not self.finished:
            self._outcome = ("error", KeyboardInterrupt())  # the dashboard says "stopped": following stopped
        else:
            self._outcome = ("ok", None) if ok else ("error", self.error or RuntimeError("a node did not end well"))
        if self.ended_at is None or stopped and not self.finished:
            self.ended_at = time.time()
        self.emit(protocol.ENDED, -1, {"ok": ok})


def _run_dir_in(folder: str) -> str:
    """``folder`` itself, or for a Slurm job's folder (submitit's) the run directory its ranks wrote in it."""
    if glob.glob(os.path.join(glob.escape(folder), f"{METRICS_PREFIX}*{METRICS_SUFFIX}")):
        return folder
    runs = glob.glob(os.path.join(glob.escape(folder), f"*{SLURM_RUN_SUFFIX}"))
    return max(runs, key=os.path.getmtime) if runs else folder


def follow(run_dir: str, *, wait: bool = True, timeout: float | None = None, callbacks: list | tuple = (),
           poll: float = POLL_S, hang_after: float | None = hangs.DEFAULT_HANG_AFTER) -> FollowedRun:
    """Show the live dashboard of a job run from an exported script, from its run directory.

    Reads the ``metrics-node*.jsonl`` files that the nodes write there (the
    export's ``--run-dir``, default beside the script; on a shared filesystem,
    or copied here) and reduces them over all ranks into ``run.history``, as for
    a job the notebook started.  The newest run in the directory is shown; a
    Slurm job's folder (``%%ddp --executor``, ``--detach``) works too.  With
    ``wait`` it follows the run until every node has ended (or shortly after a
    failure), at most ``timeout`` seconds, or until interrupted; without, it
    shows what is there now.  ``callbacks`` get each reduced record.  A run whose files gain nothing new for
    ``hang_after`` seconds is said to be stuck, with why (``run.why()``, from what its ranks wrote), once per
    hang; following goes on.
    """
    check_options(None, None, timeout, hang_after=hang_after)
    run_dir = _run_dir_in(os.path.abspath(os.path.expanduser(os.fspath(run_dir))))
    run = FollowedRun(run_dir, callbacks, hang_after)
    started = time.monotonic()
    told_waiting = False
    try:
        while True:
            run.poll()
            if not wait:
                break
            if run.finished or run.failures and run.quiet_for() >= QUIET_AFTER_FAILURE_S:
                break
            if timeout is not None and time.monotonic() - started >= timeout:
                break
            if run.run_id is not None:
                found = run.hang_watch.check(run.why)
                if found is not None:
                    print(f"ddp_notebook: the run made no progress for {hang_after:g} s (hang_after); it goes "
                          f"on. Why:\n{found}", file=sys.stderr)
            if run.run_id is None and not told_waiting:
                print(f"ddp_notebook: waiting for a run to write metrics in {run_dir}", file=sys.stderr)
                told_waiting = True
            time.sleep(poll)
    except KeyboardInterrupt:
        run.end(stopped=True)
        print(f"ddp_notebook: stopped following {run_dir}; the run goes on (follow it again to pick it up)",
              file=sys.stderr)
        return run
    except BaseException:
        run.end(stopped=True)  # the live dashboard's thread ends with its view
        raise
    finally:
        run.close_files()
    if run.run_id is None:
        print(f"ddp_notebook: no run has written metrics in {run_dir} yet", file=sys.stderr)
        return run
    run.end(stopped=not run.finished and not run.failures)
    if run.failures:
        print(f"ddp_notebook: the run failed\n{run.error}", file=sys.stderr)
    elif not run.finished:
        print(f"ddp_notebook: the run is still going ({len(run.nodes_ended)} of {run.spec.nnodes} nodes ended); "
              f"follow({run_dir!r}) again to see more", file=sys.stderr)
    return run
