"""Start, watch and stop the ranks of a job.

One mechanism for the magic, ``launch``, ``spawn`` and warm pools: a
:class:`Job` runs one task on a :class:`~ddp_notebook.engine.backend.RankBackend` (its
own, started for it, or a pool's), collects the per-rank results, blames the
rank that failed first, and reports every event to its listeners.  It knows
nothing of dashboards: views subscribe with :meth:`Job.add_listener`.
"""
from __future__ import annotations

import _signal
import contextlib
import ctypes
import enum
import functools
import itertools
import operator
import os
import signal
import sys
import threading
import time
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..wire import payload, protocol, sharing
from ..wire.errors import Failure, FailureKind, JobStopped, RankError, blame, nccl_watchdog_timeout
from .backend import RankBackend, signal_name
from .local import LocalRanks
from . import hangs, profiling, stacks
from .metrics import Metrics, RankTimings
from .output import OutputRelay, release_kernel_pipe
from .prompts import PromptRelay
from .spec import JobSpec
from .stop import Stop

log = logging.getLogger("ddp_notebook")
Listener = Callable[["Job", str, int, dict], None]
WATCHDOG_TAIL = 64 << 10  # how much of a rank's last output is searched for the NCCL watchdog's timeout message

_last_job: "Job | None" = None
_kept: "Job | None" = None  # the failed job whose failing rank waits for the debugger (Job.debug)
# For %ddp_jobs. Weak: a running job is held by its thread, an ended one only by whoever still uses it.
_background_jobs: list["weakref.ref[Job]"] = []
# Called with each job as it starts, before its ranks: where views attach their listeners.
_job_observers: list[Callable[["Job"], None]] = []
# Draws a job's dashboard again (Job.show): installed by the notebook side, which the engine never imports.
_viewer: Callable[["EventSource"], None] | None = None


def set_viewer(viewer: Callable[["EventSource"], None]) -> None:
    """Install what ``show()`` of a job (or a followed run) calls."""
    global _viewer
    _viewer = viewer


def observe_jobs(observer: Callable[["Job"], None]) -> Callable[["Job"], None]:
    """Call ``observer(job)`` for every job from now on, as it starts (once per observer)."""
    if observer not in _job_observers:
        _job_observers.append(observer)
    return observer


_task_ids = itertools.count(1)


class Phase(enum.Enum):
    """Where a job is in its life (``job.phase``); the moves it may make are :data:`MOVES`."""

    NEW = "new"  # made, not started
    RUNNING = "running"  # its ranks run the task (after a restart: again, on fresh ranks)
    STOPPING = "stopping"  # its ranks were asked to stop at their next batch boundary; they still run
    ENDING = "ending"  # its verdict is in, or it is stopped hard: its ranks are being ended (or restarted), and
    #                    their exits are no news
    ENDED = "ended"  # it said so to its listeners and keeps what it came to: status, results, history, logs


MOVES = {
    Phase.NEW: {Phase.RUNNING, Phase.ENDING},  # (stopped before it started)
    Phase.RUNNING: {Phase.STOPPING, Phase.ENDING},
    Phase.STOPPING: {Phase.ENDING},
    Phase.ENDING: {Phase.RUNNING, Phase.ENDED},  # a restart runs the task again
    Phase.ENDED: set(),
}


@dataclass(frozen=True)
class Verdict:
    """How a job's run came out, once it has: the per-rank values, or the error it failed (or was stopped) with."""

    values: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class JobOptions:
    """How a job runs, beyond where its ranks are (its :class:`JobSpec`): made once by the front door (``%%ddp``'s
    flags, ``launch()``'s arguments) and never changed; a :class:`Job` reads it and nothing else sets the job up."""

    max_restarts: int = 0  # a failed attempt is run again on fresh ranks this many times
    stop_grace: float = 10.0  # how long a graceful stop waits for a batch boundary (--grace)
    hang_after: float | None = hangs.DEFAULT_HANG_AFTER  # no progress this long: the job says why (why())
    keep_failed_rank: bool = False  # --debug: the failing rank of the job's own ranks stays for debug()
    callbacks: tuple = ()  # each reduced metric record is sent to these (engine/callbacks.py)
    profile: "profiling.ProfileOptions | None" = None  # --profile: the ranks' window of steps
    profile_folder: str | None = None  # where the merged trace goes (None: the working folder)
    # Answers the ranks' prompts (input(), pdb) with a line typed in the notebook, or raises PromptRefused
    # (EOFError: the end of input); a run in the foreground has one. None: prompts are refused.
    prompter: Callable[[str], str] | None = None
    show_where_interrupted: bool = False  # a foreground cell shows where the ranks were when stopped hard


@dataclass(frozen=True)
class Outcome:
    """Where a job stands: its status, what each rank has returned or how it failed so far, and when."""

    status: str  # 'running', 'done', 'failed' or 'stopped'
    results: dict[int, Any]  # rank -> its return value
    failures: dict[int, Failure]  # rank -> how it failed
    error: BaseException | None  # once failed or stopped
    started_at: float | None
    ended_at: float | None


class EventSource:
    """What views need of a run: listeners for its events, its metrics (``history``, ``ranks``), a way to redraw
    it, and its ``status`` ('running', 'done', 'failed', 'stopped', ...)."""

    listeners: list[Listener]
    status: str
    done: bool  # it has ended (or following it has)
    metrics: Metrics | None = None  # made with the run (a followed run's once it knows its ranks)

    def start_metrics(self, world_size: int, callbacks=()) -> None:
        """Give the run its metrics: the first of its listeners."""
        self.metrics = Metrics(world_size, callbacks)
        self.listeners.insert(0, self.metrics)

    @property
    def history(self):
        """The reduced metric records (``report()``), one a step or epoch (engine/history.py)."""
        return self.metrics.history if self.metrics is not None else []

    @property
    def ranks(self) -> RankTimings:
        """Rank -> where its time per batch went (engine/metrics.py)."""
        return self.metrics.ranks if self.metrics is not None else RankTimings()

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(job, kind, rank, body)`` for every event a rank sends."""
        self.listeners.append(listener)

    def emit(self, kind: str, rank: int, body: dict) -> None:
        """Hand an event to every listener."""
        for listener in list(self.listeners):
            listener(self, kind, rank, body)

    def show(self) -> None:
        """Draw the metrics dashboard again from the history (widgets in a notebook, text elsewhere)."""
        if _viewer is None:
            raise RuntimeError("no view to show jobs with: import ddp_notebook (its front door installs one)")
        _viewer(self)


class Job(EventSource):
    """One task run on a group of ranks; ``result()`` waits for it and returns the per-rank values.

    A job starts its own ranks and ends them afterwards, or runs on the ranks
    of a warm pool (``group``), possibly on some of them only (``targets``).
    """

    def __init__(self, spec: JobSpec, task: Any, options: JobOptions = JobOptions(), *,
                 relay: OutputRelay | None = None, grace: float = 3.0, group: RankBackend | None = None,
                 targets: list[int] | None = None, backend: Callable[[Any, OutputRelay], RankBackend] = LocalRanks,
                 on_interrupt: Callable[["Job"], None] | None = None,
                 renew: Callable[[str], RankBackend] | None = None):
        self.spec = spec
        self.task = task
        self.options = options
        self.task_id = next(_task_ids)
        self.phase = Phase.NEW
        self.relay = relay or OutputRelay(ranks=spec.output_ranks)
        self.grace = grace  # how long a failure waits for the other ranks' reports (a lost peer may be an echo)
        self.group = group
        self.targets = list(range(spec.world_size)) if targets is None else list(targets)
        self.on_interrupt = on_interrupt
        self.backend = backend  # what starts the job's own ranks (not used on a warm pool's)
        self.renew = renew  # fresh ranks for the next attempt on a pool's group (the pool restarts them)
        self._owns_group = group is None
        self.listeners: list[Listener] = []
        self.start_metrics(spec.world_size, options.callbacks)
        self._profiler = profiling.Collector(options.profile_folder) if options.profile is not None else None
        if self._profiler is not None:
            self.add_listener(self._profiler)
        self.on_done: list[Callable[["Job"], None]] = []  # called once the job has ended, on its thread
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._thread: threading.Thread | None = None
        self._verdict: Verdict | None = None  # the one record of how it came out
        # the current attempt
        self.attempt = 0  # 0, then 1, 2, ... after each restart
        self.attempts: list[dict] = []  # the failed attempts: {"attempt", "cause", "error"}
        self._task_path: str | None = None
        self._results_files: dict[int, int] = {}  # rank -> the file its result's big arrays are copied into
        self._results: dict[int, Any] = {}
        self._failures: dict[int, Failure] = {}
        self._first_failure_at: float | None = None
        self._exit_how: dict[int, str] = {}  # rank -> "SIGKILL", "exit code 3": how a rank died unreported
        self._hang_watch: hangs.HangWatch | None = None
        self._hang_diagnosis: "hangs.Diagnosis | None" = None  # the last found, kept for a timeout's error
        # stopping
        self._stop = Stop(options.stop_grace)
        self._interrupted_at_start = False  # the stop button came as the job started: the wait takes it
        self._stopped_where: dict[int, dict] = {}  # rank -> where a graceful stop ended its task
        self.stopped_at: dict | None = None  # where a graceful stop ended the task: {epoch, batch} or {step}
        self.interrupted_where: "stacks.RankStacks | None" = None  # each rank's stack as a hard interrupt came
        self.interrupted_where_told = False  # ... already printed
        # prompts and the debugger
        self._prompts = PromptRelay(self.task_id, options.prompter, send=self._send_to_rank,
                                    catch_up=self._catch_up, no_prompter=self._no_prompter_why,
                                    world_size=spec.world_size)
        self.kept_rank: int | None = None  # the failing rank that holds its failure for debug()
        self._debugged = False

    def _move(self, phase: Phase) -> None:
        if phase not in MOVES[self.phase]:
            raise RuntimeError(f"job #{self.task_id} cannot go from {self.phase.value} to {phase.value}")
        log.debug("job #%s: %s -> %s", self.task_id, self.phase.value, phase.value)
        self.phase = phase

    @property
    def stoppable(self) -> set[int]:
        """The ranks whose task said it checks for a graceful stop (a ``distributed_loader``, ``should_stop()``)."""
        return self._stop.stoppable

    @property
    def profile(self) -> "profiling.Profile | None":
        """``--profile``: where each rank's time went and the merged trace, once the job has ended."""
        return self._profiler.profile if self._profiler is not None else None

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
    def done(self) -> bool:
        """Its verdict is in (its ranks may still be ending)."""
        return self._verdict is not None

    @property
    def status(self) -> str:
        """'running' (until it has ended), 'done', 'failed' or 'stopped'."""
        if self.phase is not Phase.ENDED:
            return "running"
        stopped = isinstance(self._verdict.error, (KeyboardInterrupt, JobStopped)) or self.stopped_at is not None
        return "stopped" if stopped else "done" if self._verdict.ok else "failed"

    @property
    def outcome(self) -> Outcome:
        """A snapshot of where the job stands (the per-rank answers so far while it runs)."""
        return Outcome(self.status, dict(self._results), dict(self._failures), self.error, self.started_at,
                       self.ended_at)

    @property
    def results(self) -> list[Any] | None:
        """The per-rank return values once the job has succeeded."""
        return self._verdict.values if self._verdict is not None and self._verdict.ok else None

    @property
    def error(self) -> BaseException | None:
        """The job's error once it has failed; :class:`JobStopped` once stopped (``KeyboardInterrupt`` when
        a foreground run was interrupted)."""
        return self._verdict.error if self._verdict is not None else None

    def logs(self, rank: int) -> str:
        """Rank ``rank``'s complete output so far (stdout and stderr, its newest 16 MB), including the lines the
        cell elided or did not show (``--output 0``)."""
        world_size = self.spec.world_size
        try:
            index = operator.index(rank)  # (a numpy integer too)
        except TypeError:
            index = None
        if index is None or isinstance(rank, bool) or not 0 <= index < world_size:
            raise ValueError(f"job #{self.task_id} has ranks 0 to {world_size - 1}: no rank {rank!r}")
        return self.relay.log(index)

    @property
    def stopped_text(self) -> str | None:
        """"stopped at epoch 4, batch 17" (or "at step 17") after a graceful stop, else None."""
        where = self.stopped_at
        if where is None:
            return None
        if "step" in where:
            return f"stopped at step {where['step']}"
        sampler = f" (the loader's sampler epoch {where['sampler_epoch']})" if "sampler_epoch" in where else ""
        return f"stopped at epoch {where['epoch']}, batch {where['batch']}{sampler}"

    def __repr__(self) -> str:
        where = f"{self.spec.world_size} GPU ranks" if self.spec.gpus else f"{self.spec.world_size} CPU ranks"
        return f"<ddp_notebook Job #{self.task_id} on {where}: {self.status}>"

    # -- start -----------------------------------------------------------
    def start(self) -> "Job":
        global _last_job
        _last_job = self
        if _kept is not None:
            _kept.let_go_of_failure()  # a warm pool's ranks forget it as the next task starts; others end now
        spec = self.spec
        self._move(Phase.RUNNING)
        self.started_at = time.time()
        for observe in list(_job_observers):
            observe(self)
        if self._owns_group:
            self.group = self.backend(spec, self.relay).start(self.task, self.task_id)
        else:
            self.group.relay = self.relay
        try:
            self._begin_attempt()
        except BaseException:
            if self._owns_group:
                self.group.kill()  # (an interrupt before the task went: no rank outlives the failed start)
            raise
        try:
            self.emit(protocol.STARTED, -1, {"world_size": spec.world_size, "port": self.port,
                                              "pids": dict(self.pids)})
        except KeyboardInterrupt:
            # The stop button while the dashboard drew itself: the ranks have the task, so the wait takes it as
            # the cell's first interrupt (a graceful stop where the task can stop), not as a failed start.
            self._interrupted_at_start = True
        return self

    def _begin_attempt(self) -> None:
        after = self.options.hang_after
        if after and self.spec.timeout and after > 0.75 * self.spec.timeout:
            after = 0.75 * self.spec.timeout  # said before the process-group timeout ends it: its error tells why
        self._hang_watch = hangs.HangWatch(after)
        self.group.attach(self._on_message, self._on_exit)
        log.debug("job #%s started on %s: %s ranks, port %s (attempt %s)", self.task_id, type(self.group).__name__,
                  self.spec.world_size, self.port, self.attempt)
        if not self.group.runs_own_task:
            self._send_task()

    # -- restart ---------------------------------------------------------
    def _may_restart(self) -> bool:
        """A rank failed, restarts are left, and no one asked the job to stop."""
        return self._verdict is not None and isinstance(self._verdict.error, RankError) \
            and not self._stop.asked and self.attempt < self.options.max_restarts

    def _restart(self) -> None:
        """This attempt failed: stop every rank and run the task again on fresh ranks (a fresh port)."""
        error: RankError = self._verdict.error
        cause = self._cause_text(error)
        self.attempts.append({"attempt": self.attempt, "cause": cause, "error": error})
        log.debug("job #%s attempt %s failed (%s); restarting", self.task_id, self.attempt, cause)
        self._move(Phase.ENDING)
        self._forget_task_file()
        if self._owns_group:
            self.group.kill()
            self.group = None
        self._results, self._failures, self._exit_how = {}, {}, {}
        self._prompts.forget()
        self._first_failure_at = None
        self._verdict = None
        self._move(Phase.RUNNING)
        self.attempt += 1
        if self._owns_group:
            self.group = self.backend(self.spec, self.relay).start(self.task, self.task_id)
        else:
            self.group = self.renew(f"attempt {self.attempt} of job #{self.task_id} failed: {cause}")
            self.group.relay = self.relay
        self.emit(protocol.RESTARTED, -1, {"attempt": self.attempt, "attempts": self.options.max_restarts + 1,
                                            "cause": cause, "failure": error.failure})
        self._begin_attempt()

    def _cause_text(self, error: RankError) -> str:
        """One line on why an attempt failed: "rank 1 died (SIGKILL)"."""
        failure = error.failure
        if failure.kind == FailureKind.EXIT and failure.rank in self._exit_how:
            return f"rank {failure.rank} died ({self._exit_how[failure.rank]})"
        if failure.kind == FailureKind.TIMEOUT:
            return error.summary()
        headline = failure.headline()
        return f"rank {failure.rank} failed: {headline if len(headline) <= 100 else headline[:97] + '...'}"

    def _send_task(self) -> None:
        where = payload.for_ranks(self.task, self.group.workdir, f"task-{self.task_id}.pkl")
        self._task_path = where.get("path")
        self.group.send_to(self.targets, (protocol.RUN, {"task": self.task_id, **where, "seed": self.spec.seed,
                                                         "attempt": self.attempt,
                                                         "every_rank": len(self.targets) == self.spec.world_size,
                                                         **self._profile_options(),
                                                         **self._new_results_files()}))

    def _profile_options(self) -> dict:
        return {"profile": self.options.profile.for_ranks()} if self.options.profile is not None else {}

    def _new_results_files(self) -> dict:
        """An empty shared file for each rank's result (``sharing.results_file``), the notebook's own: a rank may
        end as soon as it has sent its result.  Those of an earlier attempt go."""
        self._close_results_files()
        for rank in self.targets:
            fd = sharing.results_file()
            if fd is None:
                return {}
            self._results_files[rank] = fd
        return {"results_files": (os.getpid(), dict(self._results_files))}

    def _close_results_files(self) -> None:
        """The results are loaded (their tensors keep the pages they map) or will never be."""
        for fd in self._results_files.values():
            os.close(fd)
        self._results_files.clear()

    # -- watch -----------------------------------------------------------
    def _pump(self, timeout: float = 0.1) -> None:
        self.group.pump(timeout)
        self._check_progress()
        self._say_if_stuck()

    def _on_message(self, rank: int, kind: str, body: dict) -> None:
        if body.get("task", self.task_id) != self.task_id:
            return  # a late word about an earlier cell of a warm pool
        if self._hang_watch is not None:
            self._hang_watch.progress()
        if kind == protocol.STOPPABLE:
            self._stop.stoppable.add(rank)
        if kind in (protocol.RESULT, protocol.FAILED, protocol.SAID):
            self._prompts.went_on(rank)
        if kind == protocol.RESULT and rank in self.targets:
            if body.get("stopped"):
                self._stopped_where[rank] = body["stopped"]
            try:
                self._results[rank] = payload.loads(body["value"])  # big arrays mapped from its results file
            except Exception as exc:
                self._add_failure(Failure(rank, type(exc).__name__, f"its return value could not be unpickled "
                                          f"in the notebook: {exc}", "", time.time(), FailureKind.USER))
        elif kind == protocol.FAILED:
            self._add_failure(Failure(rank, body["etype"], body["message"], body["traceback"], body["time"],
                                      body["kind"]))
            # The whole report in the rank's log (the cell shows it clipped where huge: RankError)
            self.relay.add_to_log(rank, f"[ddp_notebook] rank {rank}'s error:\n"
                                        f"{body['traceback'] or body['etype'] + ': ' + body['message']}\n")
            if body["kind"] == FailureKind.DEBUGGER:  # q, or the end of input, in a rank's debugger: the job stops
                self._stop.ask_hard(f"quitting the debugger of rank {rank}")
        elif kind == protocol.PROMPT:
            self._prompts.take(rank, body)
        elif kind == protocol.DEBUGGED and rank == self.kept_rank:
            self._debugged = True
        elif kind == protocol.SAID:
            if body["text"] and self._thread is None:
                self.relay.flush()
                self.relay.add_to_log(rank, body["text"])
                sys.stdout.write(self.relay.clipped(rank, body["text"], self.relay.budget))
                sys.stdout.flush()
            elif body["text"]:  # a background job's: under its own cell, with the rank's output
                self.relay.feed(rank, "stdout", body["text"].encode())
        self.emit(kind, rank, body)

    def _no_prompter_why(self) -> str:
        if self._thread is not None:
            return f"job #{self.task_id} runs in the background and its cell has returned, so no input box can " \
                   f"reach the notebook (run the cell in the foreground to debug it)"
        return f"nothing answers the prompts of job #{self.task_id}"

    def _send_to_rank(self, rank: int, message: tuple) -> None:
        self.group.send(rank, message)

    def _catch_up(self) -> None:
        """What the ranks printed so far is shown (before a prompt is asked)."""
        self.group.pump(0)
        self.relay.flush()

    def _answer_prompts(self) -> None:
        """Ask the ranks' prompts in the notebook (the prompt relay); an interrupt at a prompt stops the job."""
        stopped_by = self._prompts.ask_waiting(lambda: self._stop.hard)
        if stopped_by is not None:
            self._stop.ask_hard(stopped_by)

    def _on_exit(self, rank: int, code: int | None) -> None:
        if rank not in self._results and rank not in self._failures and self._verdict is None \
                and self.phase in (Phase.RUNNING, Phase.STOPPING):
            if code is not None:
                self._exit_how[rank] = signal_name(code) if code < 0 else f"exit code {code}"
            watchdog = nccl_watchdog_timeout(self.relay.log(rank)[-WATCHDOG_TAIL:]) \
                if code in (-signal.SIGABRT, 128 + signal.SIGABRT) else None
            if watchdog:  # NCCL's watchdog ended the rank at the timeout: a collective timed out, not a crash
                self._add_failure(Failure(rank, "DistBackendError", f"collective timed out (NCCL watchdog): "
                                          f"{watchdog} (the watchdog then ended the rank with SIGABRT)", "",
                                          time.time(), FailureKind.TIMEOUT))
            else:
                self._add_failure(Failure(rank, "RankDied", self.group.describe_exit(rank, code), "", time.time(),
                                          FailureKind.EXIT))
        self._prompts.went_on(rank)
        self.emit(protocol.EXITED, rank, {"code": code})

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
            wait = 0.3 if kinds & {FailureKind.USER, FailureKind.STARTUP} else \
                0.5 if FailureKind.EXIT in kinds else self.grace
            if answered >= set(targets) or time.monotonic() - self._first_failure_at >= wait:
                self._fail()
            return
        if len(self._results) == len(targets):
            if self._stopped_where:
                self.stopped_at = self._stopped_where.get(targets[0]) or next(iter(self._stopped_where.values()))
            self._verdict = Verdict(values=payload.joined_results([self._results[r] for r in targets]))
            return
        group = self.group
        if spec.init_group and len(group.ready) + len(group.exited) < spec.world_size \
                and group.started_at is not None and time.time() - group.started_at > spec.startup_timeout:
            late = sorted(set(range(spec.world_size)) - group.ready)
            self._add_failure(Failure(late[0], "StartupTimeout",
                                      f"ranks {', '.join(map(str, late))} did not join the process group within "
                                      f"{spec.startup_timeout:.0f} s (start-up bound, not --timeout)",
                                      "", time.time(), FailureKind.STARTUP))

    def _fail(self) -> None:
        failures = sorted(self._failures.values(), key=lambda f: f.rank)
        cause = blame(failures)
        note = ""
        timed_out = [f.rank for f in failures if f.kind == FailureKind.TIMEOUT]
        if cause.kind == FailureKind.TIMEOUT:
            finished = sorted(self._results)
            note = f"ranks {', '.join(map(str, timed_out))} were stuck in a collective until the timeout " \
                   f"({f'{self.spec.timeout} s' if self.spec.timeout else 'torch default'})"
            if finished:
                note += f"; rank(s) {', '.join(map(str, finished))} finished the cell without joining it"
            elif len(timed_out) < len(self.targets):
                stuck_elsewhere = sorted(set(self.targets) - set(timed_out))
                note += f"; rank(s) {', '.join(map(str, stuck_elsewhere))} were elsewhere"
            waiting = [r for r in self.targets if r not in self._results and r not in self._failures]
            if waiting:
                note += f"\nwhere the other ranks were:\n{stacks.collect(self.group, waiting)}"
            if self._hang_diagnosis is not None:
                note += f"\nwhy it was stuck (at {self._hang_diagnosis.at}):\n{self._hang_diagnosis}"
        others = [f.rank for f in failures if f.rank != cause.rank]
        if len(failures) == len(self.targets) > 1 and len({f.headline() for f in failures}) == 1:
            note = "(every rank failed the same way)"
        elif others and cause.kind != FailureKind.TIMEOUT:
            note = f"(rank(s) {', '.join(map(str, others))} failed after it, as a consequence)"
        earlier = [f"attempt {a['attempt'] + 1}: {a['cause']}" for a in self.attempts]
        self._verdict = Verdict(error=RankError(cause, failures, note, earlier, self.relay.whole_text_at(cause.rank)))

    # -- wait / stop -----------------------------------------------------
    def result(self) -> list[Any]:
        """Wait for the job; the per-rank return values, or raise the first rank's error."""
        return self.wait()

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most ``timeout`` seconds for a background job; True once it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
            return self.done and not self._thread.is_alive()
        return self.done

    def wait(self, timeout: float | None = None) -> list[Any]:
        """Wait (at most ``timeout`` seconds for a background job); what the foreground run would return."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"job #{self.task_id} is still running after {timeout} s")
        elif self.phase is not Phase.ENDED:
            with self._stacks_on_sigusr2():
                self._run()
        if not self._verdict.ok:
            raise self._verdict.error
        return self._verdict.values

    @contextlib.contextmanager
    def _stacks_on_sigusr2(self):
        """While a foreground job runs, ``kill -USR2 <kernel pid>`` prints every rank's stack into the cell
        (the kernel is busy: no magic can ask); the job goes on."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        # _signal: signal.signal's calls without its enum conversions, as in wire/channel.py's whole_message
        previous = _signal.signal(signal.SIGUSR2, lambda signum, frame: print(
            f"ddp_notebook: where each rank is (job #{self.task_id}):\n{self.stacks()}", file=sys.stderr))
        try:
            yield
        finally:
            _signal.signal(signal.SIGUSR2, previous)

    def _run(self) -> None:
        try:
            if self._owns_group:
                self._finish_start()
            while True:
                while self._verdict is None and not self._stop.hard:
                    self._pump_or_stop_gracefully()
                if not self._may_restart():
                    break
                self._restart()
        except BaseException:
            self._stop_now()
            raise
        if self._verdict is None:
            self._stop_now()  # stop() asked for it
        else:
            self._finish()

    def _finish_start(self) -> None:
        """Start the ranks the cell's thread left to this one (a background job's, while the rank template was not
        ready); a failure to start them is the job's."""
        try:
            self.group.finish_start(lambda: self._stop.hard)
        except Exception as exc:  # noqa: BLE001 - said as the job's error, in its cell
            self._verdict = Verdict(error=exc)

    def _pump_or_stop_gracefully(self) -> None:
        """Pump; the first interrupt asks a task that checks for it to stop at its next batch boundary.  A second
        interrupt, or no boundary within the grace (``JobOptions.stop_grace``), stops it hard (KeyboardInterrupt;
        :class:`JobStopped` for ``job.stop()``)."""
        stop = self._stop
        at_start = self._interrupted_at_start and threading.current_thread() is threading.main_thread()
        try:
            if at_start:
                self._interrupted_at_start = False
                raise KeyboardInterrupt
            if stop.pending is not None and stop.sent_at is None:
                self._ask_to_stop(stop.pending)
            self._pump()
            self._answer_prompts()
        except KeyboardInterrupt:
            # Ranks interrupted as they were given the task have not reached their loop to say that it can stop
            # gracefully: they are asked too, and are stopped hard if none says so within ANNOUNCE_WAIT_S.
            if stop.sent_at is None and (stop.stoppable or at_start):
                self._ask_to_stop("the interrupt")
                return
            raise
        if self._verdict is None and stop.expired():
            log.debug("job #%s: no batch boundary within %s s; stopping hard", self.task_id, stop.grace_now())
            self._on_grace_expired()
            if stop.by_call:
                stop.ask_hard()  # job.stop(): the stop becomes a hard one (JobStopped)
            else:
                raise KeyboardInterrupt

    def _ask_to_stop(self, by: str) -> None:
        """Ask every rank to stop at the next batch boundary (they agree on the same one)."""
        self._stop.sent()
        self._move(Phase.STOPPING)
        log.debug("job #%s: graceful stop asked by %s", self.task_id, by)
        self.emit(protocol.STOPPING, -1, {"by": by, "grace": self._stop.grace})
        self.group.send_to(self.targets, (protocol.STOP, {"task": self.task_id}))

    def _on_grace_expired(self) -> None:
        """A graceful stop found no boundary in time: say so, and where each rank was."""
        self.interrupted_where = self.stacks()
        self.interrupted_where_told = True
        print(f"ddp_notebook: no batch boundary within {self._stop.grace_now():g} s of the stop; stopping hard. "
              f"Where each rank was:\n{self.interrupted_where}", file=sys.stderr)

    def stacks(self) -> "stacks.RankStacks":
        """Every rank's Python stack now, grouped by identical stacks ("ranks 0, 2: all_reduce ← Cell In[5]
        line 12"); works while a rank is blocked in a collective or in C code.  ``frames[rank]`` has the frames."""
        if self.group is None:
            raise RuntimeError(f"job #{self.task_id} has no ranks (not started)")
        return stacks.collect(self.group, list(self.targets))

    # -- hangs -----------------------------------------------------------

    def why(self) -> "hangs.Diagnosis":
        """Why the job is stuck: which ranks wait in which collective (name and number, from torch's Flight
        Recorder), which rank has not joined it and where it is (the cell's line), which ranks finished already,
        which called another collective than the others."""
        if self.group is None:
            raise RuntimeError(f"job #{self.task_id} has no ranks (not started)")
        self._hang_diagnosis = hangs.diagnose(self.group, list(self.targets), sorted(self._results))
        return self._hang_diagnosis

    def _say_if_stuck(self) -> None:
        """``hang_after`` seconds without progress: say why, once; the job goes on (the user stops it or waits)."""
        if self._hang_watch is None or self._verdict is not None or self.phase is not Phase.RUNNING:
            return
        if not set(self.targets) <= self.group.ready:
            self._hang_watch.progress()  # still starting: the start-up bound applies, not hang_after
            return
        found = self._hang_watch.check(self.why)
        if found is not None:
            print(f"ddp_notebook: job #{self.task_id} made no progress for {self._hang_watch.hang_after:g} s "
                  f"(--hang-after); it goes on. Why:\n{found}", file=sys.stderr, flush=True)
            self.emit(protocol.HANG, -1, {"text": found.text})

    def run_in_background(self) -> "Job":
        background_jobs()  # forgets the jobs no longer referred to
        _background_jobs.append(weakref.ref(self))
        self._thread = threading.Thread(target=self._run_quietly, name="ddp-job", daemon=True)
        self._thread.start()
        return self

    def _run_quietly(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001
            if self._verdict is None:
                self._verdict = Verdict(error=exc)
        finally:
            release_kernel_pipe()  # the descriptor a kernel gave this thread for its output, closed now
            trim_heap()

    def _finish(self) -> None:
        """Let ranks exit cleanly on success; stop them at once on failure (with ``keep_failed_rank``, all but the
        failing one, which waits for :meth:`debug`)."""
        self._move(Phase.ENDING)
        failed = not self._verdict.ok
        if failed:
            self._keep_failure()
        if self._owns_group:
            if not failed:
                self.group.shut_down()
            elif self.kept_rank is not None:
                self.group.signal([r for r in self.targets if r != self.kept_rank], signal.SIGKILL)
            else:
                self.group.kill()
        self._end()

    def _keep_failure(self) -> None:
        """Where the failing rank reported a Python error and stays up (a warm pool's rank, or ``keep_failed_rank``
        on ranks that serve tasks), it keeps its failure for :meth:`debug`."""
        global _kept
        error = self._verdict.error
        if not isinstance(error, RankError) or error.failure.kind != FailureKind.USER \
                or not self.group.keeps_failed_rank:
            return
        if self._owns_group and not self.options.keep_failed_rank:
            return
        self.kept_rank = error.rank
        _kept = self

    def debug(self, prompter: Callable[[str], str] | None = None) -> None:
        """Open the debugger post mortem in the rank kept at its failure (``%%ddp --debug``, ``launch(...,
        debug=True)``, or a warm pool's last failed cell): its prompts are answered by ``prompter`` (by default
        the job's own, ``JobOptions.prompter``); ``u`` and ``d`` walk the rank's own traceback.  Returns when the
        user quits or continues (KeyboardInterrupt when interrupted); the job's own ranks end then, a warm pool's
        rank goes back to the pool."""
        rank = self.kept_rank
        if rank is None or self.group is None or rank not in self.group.alive:
            self.let_go_of_failure()
            raise RuntimeError(f"job #{self.task_id} has no rank kept at its failure any more (its ranks have "
                               f"ended, or a warm pool ran another task or restarted them)")
        self._debugged = False
        self._stop = Stop(self.options.stop_grace)  # the session's own: quitting the debugger or an interrupt
        self._prompts.debug_session(prompter)
        self.group.send(rank, (protocol.DEBUG, {"task": self.task_id}))
        try:
            while not self._debugged and not self._stop.hard and rank in self.group.alive:
                self.group.pump(0.1)
                self._answer_prompts()
        except KeyboardInterrupt:
            self._stop.ask_hard()
        interrupted = self._stop.hard and not self._debugged
        try:
            if interrupted and not self._owns_group:
                self._leave_debugger(rank)
        finally:
            self.let_go_of_failure()
        if interrupted:
            raise KeyboardInterrupt(f"the debugger of rank {rank} was interrupted; the rank "
                                    f"{'has ended' if self._owns_group else 'went back to the warm pool'}")
        if self._prompts.refusal is not None:
            raise RuntimeError(f"the debugger of rank {rank} could not ask: {self._prompts.refusal}")

    def _leave_debugger(self, rank: int) -> None:
        """A warm pool's rank in the debugger post mortem, interrupted in the notebook: its prompts are refused
        (the one asked, those waiting and those on their way) until it has left the debugger."""
        self._prompts.refuse_all(rank, "the debugger was interrupted in the notebook")
        deadline = time.monotonic() + self.grace
        while not self._debugged and rank in self.group.alive and time.monotonic() < deadline:
            self.group.pump(0.05)  # (a prompt arriving now is refused at once)

    def let_go_of_failure(self) -> None:
        """Forget the rank kept at its failure; the job's own ranks end now."""
        global _kept
        if _kept is self:
            _kept = None
        if self.kept_rank is not None and self._owns_group and self.group is not None:
            self.group.kill()
        self.kept_rank = None

    def stop(self, timeout: float | None = 10.0, *, by: str = "job.stop()", now: bool = False) -> None:
        """Stop the job; its ``status`` becomes 'stopped'.

        Gracefully when its task checks for it (a ``distributed_loader``, ``should_stop()``) and ``now`` is
        False: every rank stops at the same batch boundary, the cell ends normally and ``wait()`` returns the
        values (``stopped_at`` says where).  Otherwise, or with no boundary within ``stop_grace`` seconds, hard:
        its own ranks are ended (a warm pool brings its ranks back) and ``wait()`` raises :class:`JobStopped`
        naming ``by``.  Waits at most ``timeout`` seconds (a graceful stop: the grace period more; None: until
        it has ended).
        """
        thread = self._thread
        on_its_thread = thread is not None and thread.is_alive() and thread is not threading.current_thread()
        if not now and self._stop.stoppable and self._verdict is None and on_its_thread:
            self._stop.ask_gracefully(by)  # the job's own thread sends it: it owns the ranks' connections
            thread.join(None if timeout is None else timeout + self._stop.grace)
            return
        if on_its_thread:
            self._stop.ask_hard(by)  # the job's own thread stops it: it owns the ranks' pipes
            thread.join(timeout)
            return
        if self.phase is not Phase.ENDED:
            self._stop.ask_hard(by)
            self._stop_now()

    def _stop_now(self) -> None:
        if self.phase is Phase.ENDED:
            return
        if self.phase is not Phase.ENDING:
            self._move(Phase.ENDING)
        if self._verdict is None:  # stopped, or a foreground run interrupted (Jupyter's stop button)
            hard = self._stop.hard
            self._verdict = Verdict(error=JobStopped(self.task_id, self._stop.by) if hard else KeyboardInterrupt())
            if not hard and self.interrupted_where is None and self.options.show_where_interrupted:
                self.interrupted_where = self._where_now()
        if self._owns_group:
            if self.group is not None:
                self.group.kill()
        elif self.on_interrupt is not None:
            self.on_interrupt(self)
        self._end()

    def _where_now(self) -> "stacks.RankStacks | None":
        """Every rank's stack before a hard stop ends it (briefly: the user is waiting)."""
        try:
            if self.group is not None and self.group.alive:
                found = stacks.collect(self.group, list(self.targets), wait=1.0)
                return found if any(frames is not None for frames in found.frames.values()) else None
        except (Exception, KeyboardInterrupt):  # noqa: BLE001 - a second interrupt: stop without it
            pass
        return None

    def _forget_task_file(self) -> None:
        if self._task_path is not None:
            try:
                os.unlink(self._task_path)
            except OSError:
                pass
            self._task_path = None

    def _end(self) -> None:
        self._forget_task_file()
        self._close_results_files()
        payload.release(self.task)  # its shared arrays: the ranks have mapped them or are gone
        self.spec.release_devices()  # for other jobs (a pool job's spec holds none: the pool holds them)
        if self.phase is not Phase.ENDED:
            self.ended_at = time.time()
            self._move(Phase.ENDED)
            log.debug("job #%s ended: %s", self.task_id, self.status)
            self.relay.flush(final=True)
            self.relay.close_logs()
            self.emit(protocol.ENDED, -1, {"ok": self._verdict.ok})
            try:
                for callback in self.on_done:
                    callback(self)
            finally:
                self._let_go()

    def _let_go(self) -> None:
        """The job has ended and said so: keep what it came to (status, results, history, logs), not what ran it.
        A background job lives as long as the notebook refers to it (``Out[n]``), for hours."""
        self.task = None  # the pickled cell or call: its names, the notebook's cell sources
        self.on_done = []  # called once; the magic's hold the cell's names


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    What a background job allocated on its threads (its messages, its dashboard's drawing) is freed when it ends,
    but glibc keeps the freed pages of each thread's arena mapped: without this, 60 background jobs grew a kernel by
    16-22 MiB of pages nothing used.  A few milliseconds, on the job's own thread once it has ended."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def last_job() -> Job | None:
    """The most recently started job."""
    return _last_job


def kept_failure() -> Job | None:
    """The failed job whose failing rank waits for the debugger (:meth:`Job.debug`), if any."""
    return _kept


def background_jobs() -> list[Job]:
    """The background jobs of this process (``%%ddp --background``, ``launch(..., background=True)``), oldest
    first: those running, and those ended that something still refers to."""
    jobs = [ref() for ref in _background_jobs]
    _background_jobs[:] = [ref for ref, job in zip(_background_jobs, jobs) if job is not None]
    return [job for job in jobs if job is not None]
