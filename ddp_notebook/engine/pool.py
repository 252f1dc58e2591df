"""A warm pool: ranks and a process group that live across cells.

``%ddp_start`` starts the ranks once; every ``%%ddp`` cell without device flags
then runs on them as a :class:`~ddp_notebook.Job` over the pool's
:class:`~ddp_notebook.engine.local.LocalRanks`.  The ranks keep the cell's names, so
the model stays where it is, and only notebook names that are new or changed
(rebound or mutated in place) are shipped again.  After an error or an
interrupt the pool checks that its ranks are back at a common point; if they
are not, it restarts them and says that their state is gone.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import pickle
import signal
import sys
import time
from typing import Any

import cloudpickle

from ..wire import payload, protocol
from .job import Job, JobOptions
from .spec import JobSpec
from ..wire.errors import FailureKind, LaunchError
from .output import OutputRelay
from .backend import RankBackend, signal_name
from .local import LocalRanks

_current: "Pool | None" = None

_INTERRUPT_WAIT_S = 3.0
_SYNC_TIMEOUT_S = 5.0  # every rank back at the store
_CHECK_TIMEOUT_S = 5.0  # the process group's check after it (rank.worker._check_group)
_REPLICAS_TIMEOUT_S = 120.0  # the DDP replicas compared, and rank 0's copied where they differ (rank.replicas)


def current() -> "Pool | None":
    """The warm pool of this kernel, if one is up."""
    return _current if _current is not None and _current.group is not None else None


class _FingerprintPickler(cloudpickle.Pickler):
    """Pickles for a digest only: large arrays enter it by a cheap token, not their bytes.  An open file fails, unread
    (the payload refuses it: its name is shipped, and refused there)."""

    dispatch_table = payload.with_files_refused(cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        numpy = sys.modules.get("numpy")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.numel() * obj.element_size() > _SMALL:
            # Every in-place change bumps a tensor's version counter, so an unchanged dataset costs
            # nothing to recognise; the edges of its bytes guard against a new tensor at a reused address.
            flat = obj.detach().reshape(-1)
            edges = torch.cat([flat[:512], flat[-512:]]).cpu().numpy().tobytes()
            return _Digest, ("tensor", obj.data_ptr(), obj._version, tuple(obj.shape), obj.stride(),
                             str(obj.dtype), obj.requires_grad, hashlib.blake2b(edges).hexdigest())
        if numpy is not None and isinstance(obj, numpy.ndarray) and obj.nbytes > _SMALL and obj.dtype != object:
            digest = hashlib.blake2b(numpy.ascontiguousarray(obj).tobytes(), digest_size=16)
            return _Digest, (digest.hexdigest(), str(obj.dtype), obj.shape)
        return super().reducer_override(obj)


_SMALL = 1 << 16


class _Digest:
    def __init__(self, *args):
        self.args = args


def fingerprint(value: Any) -> str | None:
    """A digest that changes when the value is rebound or mutated in place; None if it cannot be taken."""
    buffer = io.BytesIO()
    try:
        _FingerprintPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:
        return None
    return hashlib.blake2b(buffer.getvalue(), digest_size=16).hexdigest()


class Pool:
    """Warm ranks for this kernel; see the module docstring."""

    def __init__(self, spec: JobSpec):
        self.spec = spec
        self.group: RankBackend | None = None
        self.cells = 0
        self.restarts = 0
        self.busy: Job | None = None  # the job running on the pool (a background one, between cells)
        self._stopping = False
        # What each rank holds of the notebook's names: name -> fingerprint at shipping time (or at the
        # moment the ranks bound the name themselves, so their value wins until the notebook changes its own).
        self._held: list[dict[str, str]] = []
        # The version of the notebook's cell sources each rank has installed (for its tracebacks,
        # payload.sources_since): later cells send only new or changed ones, so a cell's task does not grow with
        # the notebook's history.
        self._sources_version: list[int] = []
        # Every name a cell bound on the ranks or was sent (None: a cell bound names no reading can tell);
        # a cell may read them though the notebook has none.  Not cleared by a restart: better a late NameError
        # than a false refusal.
        self.rank_names: set[str] | None = set()

    # -- life ------------------------------------------------------------
    def start(self) -> "Pool":
        global _current
        spec = self.spec
        group = LocalRanks(spec, OutputRelay()).start()
        failures: list[str] = []
        group.attach(lambda rank, kind, body: failures.append(
            f"rank {rank}: {body['etype']}: {body['message']}") if kind == protocol.FAILED else None)
        try:
            group.finish_start(lambda: False)  # (the pool waits for its ranks here, whoever starts it)
            deadline = time.time() + spec.startup_timeout
            while len(group.ready) < spec.world_size:
                group.pump(0.05)
                if failures or group.exited or time.time() > deadline:
                    reason = "; ".join(failures) or (f"rank(s) {sorted(group.exited)} exited" if group.exited
                                                     else f"not ready within {spec.startup_timeout:.0f} s")
                    raise LaunchError(f"the warm pool did not start: {reason}")
        except BaseException:
            group.kill()
            spec.release_devices()
            raise
        group.relay.flush(final=True)
        self.group = group
        self._held = [{} for _ in range(spec.world_size)]
        self._sources_version = [0] * spec.world_size
        _current = self
        return self

    def stop(self) -> None:
        """End the ranks cleanly and remove everything the pool left."""
        global _current
        self._stopping = True  # a job still running ends without bringing the ranks back
        if self.busy is not None:
            self.busy.stop(timeout=None, by="%ddp_stop (the warm pool was stopped)", now=True)
        if self.group is not None:
            self.group.shut_down(wait=5.0)
            self.group = None
        self.spec.release_devices()
        if _current is self:
            _current = None

    def restart(self, reason: str) -> None:
        """Replace the ranks; everything they held is lost, and the user is told so."""
        if self.group is not None:
            self.group.kill()
            self.group = None
        if self._stopping:
            return
        print(f"ddp_notebook: {reason}; the warm pool was restarted and the names its ranks held are gone",
              file=sys.stderr)
        self.restarts += 1
        self.start()

    def _renew(self, reason: str) -> RankBackend:
        """A job's attempt failed and it restarts: fresh ranks (a fresh port) for its next attempt."""
        self.restart(reason)
        return self.group

    def status(self) -> list[dict]:
        """One row per rank: pid, alive, device, resident memory."""
        import psutil

        rows = []
        for rank in range(self.spec.world_size):
            pid = self.group.pids.get(rank) if self.group else None
            alive = self.group is not None and rank in self.group.alive
            rss = None
            if alive:
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    alive = False
            device = f"cuda:{rank} (GPU {self.spec.gpus[rank]})" if self.spec.gpus else "cpu"
            rows.append({"rank": rank, "pid": pid, "alive": alive, "device": device, "rss": rss})
        return rows

    # -- cells -----------------------------------------------------------
    def refuse_job_options(self, **options: Any) -> None:
        """Options fixed when the pool started cannot change for one cell or call."""
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise LaunchError(f"{', '.join(given)} are set when a warm pool starts (%ddp_start); name devices "
                              f"(--gpus/--cpus) to run a fresh job instead")

    def spec_for(self, seed: int | None = None, output_ranks: set[int] | None = None) -> JobSpec:
        """The pool's spec with one cell's own settings."""
        return dataclasses.replace(self.spec, seed=seed, output_ranks=output_ranks, notes=[],
                                   reservation=None)  # the pool holds its GPUs, not its cells

    def to_ship(self, names: dict[str, Any], targets: list[int]) -> dict[str, Any]:
        """The names some target rank does not hold in their current notebook version."""
        shipped = {}
        for name, value in names.items():
            mark = fingerprint(value)
            if mark is None or any(self._held[r].get(name) != mark for r in targets):
                shipped[name] = value
        return shipped

    def hold_names(self, bound: set[str] | None) -> None:
        """The ranks now hold these names too (a cell bound them, or was sent them); None: a cell whose names
        cannot be told, so any name may be the ranks' own from now on."""
        self.rank_names = None if bound is None or self.rank_names is None else self.rank_names | bound

    def sources_to_ship(self, targets: list[int]) -> tuple[payload.Sources, int]:
        """The notebook's cell sources some target rank has not installed as they are now, and the version the
        targets hold once they have (for :meth:`cell_done`)."""
        return payload.sources_since(min(self._sources_version[r] for r in targets))

    def job(self, task: bytes, spec: JobSpec, options: JobOptions = JobOptions(), targets: list[int] | None = None,
            relay: OutputRelay | None = None) -> Job:
        """A job for one cell (or call) on the pool's ranks."""
        if self.busy is not None:
            raise LaunchError("the warm pool is busy with a background job: wait for it (job.wait()) or stop it")
        self.ensure_alive()
        targets = list(range(self.spec.world_size)) if targets is None else targets
        bad = [r for r in targets if not 0 <= r < self.spec.world_size]
        if bad:
            raise LaunchError(f"--ranks {bad}: the pool has ranks 0 to {self.spec.world_size - 1}")
        job = Job(spec, task, options, group=self.group, targets=targets, relay=relay,
                  on_interrupt=self._interrupted, renew=self._renew)
        job.add_listener(lambda job, kind, rank, body: setattr(self, "busy", job) if kind == protocol.STARTED else None)
        job.on_done.append(self._job_ended)
        return job

    def _job_ended(self, job: Job) -> None:
        """On the job's own thread, before anyone may use the pool again: recover from a failure."""
        try:
            if job.status == "failed" and self.group is job.group:
                self._after_failure(job)
        finally:
            self.busy = None

    def cell_done(self, job: Job, shipped: dict[str, Any], assigned: frozenset[str], user_ns: dict,
                  returned: dict[str, Any] | None = None, sources_version: int | None = None) -> None:
        """After a cell: remember what the ranks hold now.

        Names the ranks bound (``assigned``: what the cell binds at its top level, as the notebook side read it;
        or sent back with ``--return``) are theirs: the notebook's value of the same name is shipped again only
        once it changes.
        The cell sources sent are installed on the ranks that ran the cell through (after a failure, they are
        sent again: the task may have failed before it installed them).
        """
        self.cells += 1
        if self.group is None or job.group is not self.group:
            return  # restarted: the new ranks hold nothing
        if sources_version is not None:
            for rank in set(job.targets) & set(job.outcome.results):
                self._sources_version[rank] = max(self._sources_version[rank], sources_version)
        if job.results is None:  # what the failed cell bound, or was sent, may be missing or half-made
            for rank in job.targets:
                for name in assigned | set(shipped):
                    self._held[rank].pop(name, None)
            return
        marks = {name: fingerprint(value) for name, value in shipped.items()}
        returned = returned or {}
        bound = {name: fingerprint(returned[name] if name in returned else user_ns[name])
                 for name in assigned | set(returned) if name in user_ns or name in returned}
        for rank in job.targets:
            self._held[rank].update({n: m for n, m in marks.items() if m is not None})
            self._held[rank].update({n: m for n, m in bound.items() if m is not None})

    def ensure_alive(self) -> None:
        """Restart the ranks if one has died (the user is told).  Call before working out what to ship: fresh
        ranks hold nothing."""
        if self.group is None:
            raise LaunchError("the warm pool was stopped; start one with %ddp_start")
        dead = sorted(set(range(self.spec.world_size)) - set(self.group.alive))
        if dead:
            self.restart(f"rank(s) {', '.join(map(str, dead))} of the warm pool had died")

    def _answered(self, job: Job) -> bool:
        outcome = job.outcome
        answered = set(outcome.results) | {r for r, f in outcome.failures.items()
                                           if f.kind in (FailureKind.USER, FailureKind.INTERRUPTED,
                                                         FailureKind.DEBUGGER)}
        return answered >= set(job.targets) and not self.group.exited

    def _after_failure(self, job: Job) -> None:
        # Every rank came back from the cell (they failed alike, before any collective): the pool
        # stays.  A rank still waiting in a collective (or dead) means the group cannot be trusted.
        deadline = time.monotonic() + 0.5
        while not self._answered(job) and time.monotonic() < deadline:
            self.group.pump(0.05)
        if not self._answered(job):
            outcome = job.outcome
            waiting = sorted(set(job.targets) - set(outcome.results) - set(outcome.failures))
            why = f"rank(s) {', '.join(map(str, waiting))} were left waiting in a collective" if waiting else \
                "a rank failed inside a collective"
            self.restart(why)

    def _interrupted(self, job: Job) -> None:
        """Interrupt stops the cell, not the pool: bring every rank back to a common point, or restart."""
        if self._stopping:
            self.restart("stopping")  # only ends the ranks
            return
        try:
            why, checked = self._bring_back(job)
        except KeyboardInterrupt:  # yet another interrupt: the ranks may be anywhere in the checks' collectives
            why, checked = "the ranks were interrupted again while they were brought back", []
        if why is not None:
            self.restart(why)
            return
        print(f"ddp_notebook: cell interrupted; {replicas_news(checked)}", file=sys.stderr)

    def _bring_back(self, job: Job) -> tuple[str | None, list[dict]]:
        group = self.group
        group.signal(job.targets, signal.SIGINT)
        deadline = time.monotonic() + _INTERRUPT_WAIT_S
        while not self._answered(job) and time.monotonic() < deadline:
            group.pump(0.05)
        if not self._answered(job):
            return "the ranks could not be brought back to a common point after the interrupt", []
        return self._sync(job.task_id)

    def _sync(self, task_id: int) -> tuple[str | None, list[dict]]:
        """Every rank meets at the store, then checks the process group (``rank.worker._check_group``: on a GPU
        the device is synchronised first) and its DDP replicas (``rank.replicas.reconcile``).  (None, what the
        replica check found) when the pool may keep its ranks, else (why it may not, [])."""
        group = self.group
        at: dict[str, set[int]] = {"store": set(), "group": set(), "replicas": set()}  # the ranks past each stage
        failed: dict[int, dict] = {}
        checked: list[dict] = []

        def handler(rank, kind, body):
            if body.get("task") == task_id:
                if kind == protocol.SYNCED:
                    at[body.get("stage", "group")].add(rank)
                    if rank == 0 and body.get("stage") == "replicas":
                        checked[:] = body.get("replicas") or []
                elif kind == protocol.FAILED:
                    failed[rank] = body

        everyone = set(range(self.spec.world_size))
        with group.diverted(handler):
            for rank in everyone:
                group.send(rank, (protocol.SYNC, {"task": task_id, "timeout": _SYNC_TIMEOUT_S,
                                                  "check_timeout": _CHECK_TIMEOUT_S}))
            # The store wait, then the check; a rank stuck in either (in C code, or the GPU) is ended by the restart.
            # A rank that ends in the check (gloo aborts a rank whose stale collective gets the check's data) cuts
            # the wait for the others' reports to a second.
            deadline = time.monotonic() + _SYNC_TIMEOUT_S + _CHECK_TIMEOUT_S + 1
            while at["group"] | set(failed) | set(group.exited) != everyone and time.monotonic() < deadline:
                if group.exited:
                    deadline = min(deadline, time.monotonic() + 1)
                group.pump(0.05)
            # The replica check copies rank 0's model (and its optimizer state) where they differ: its own deadline.
            deadline = time.monotonic() + _REPLICAS_TIMEOUT_S
            while at["group"] == everyone and at["replicas"] | set(failed) | set(group.exited) != everyone \
                    and time.monotonic() < deadline:
                if group.exited:
                    deadline = min(deadline, time.monotonic() + 1)
                group.pump(0.05)
        if at["replicas"] == everyone:
            return None, checked
        if at["group"] == everyone and not failed and not group.exited:
            return f"the check of the DDP replicas after the interrupt did not finish within " \
                   f"{_REPLICAS_TIMEOUT_S:g} s", []
        # One rank past the store barrier means every rank reached it: what failed after that is the process group
        # (a rank whose stale collective gets the check's data may end before it says it is past the barrier).
        if not at["store"]:
            return "the ranks could not be brought back to a common point after the interrupt", []
        out_of_step = "after the interrupt the ranks' process group was out of step (a collective one rank " \
                      "started was left unmatched)"
        ended = sorted(group.exited)
        if ended:
            codes = [group.exited[r] for r in ended]
            how = ", ".join(signal_name(c) if isinstance(c, int) and c < 0 else f"exit {c}" for c in codes)
            return f"{out_of_step}: rank(s) {', '.join(map(str, ended))} ended in the check's all_reduce ({how})", []
        in_replicas = sorted(rank for rank, body in failed.items() if body.get("stage") == "replicas")
        if in_replicas:
            rank = in_replicas[0]
            return f"the check of the DDP replicas after the interrupt failed on rank {rank}: " \
                   f"{' '.join(failed[rank]['message'].split())[:300]}", []
        if failed:
            rank = min(failed)
            return f"{out_of_step}: rank {rank}: {' '.join(failed[rank]['message'].split())[:300]}", []
        silent = sorted(everyone - at["group"])
        return f"{out_of_step}: rank(s) {', '.join(map(str, silent))} did not finish the check within " \
               f"{_CHECK_TIMEOUT_S:g} s", []


def replicas_news(checked: list[dict]) -> str:
    """What the replica check after an interrupt found, for the user: in step, or what was made one again."""
    def called(entry):
        return f"{entry['name']!r}" if entry["name"] else "a DDP model the cell holds by no name"

    drifted = [entry for entry in checked if not entry["agreed"]]
    if not drifted:
        models = ", ".join(called(entry) for entry in checked)
        return "the warm pool's ranks are back and keep their state" + \
            (f" (the DDP replicas of {models} are the same on every rank)" if checked else "")
    said = []
    for entry in drifted:
        if entry.get("problem"):
            said.append(entry["problem"])
            continue
        forwards = entry["forwards"]
        if len(set(forwards)) > 1:
            ahead = max(range(len(forwards)), key=forwards.__getitem__)
            how = f"rank {ahead} was {forwards[ahead] - min(forwards)} training step(s) ahead " \
                  f"(training forwards per rank: {', '.join(map(str, forwards))})"
        else:
            how = "their parameters differed after the same number of training steps"
        copied = "parameters and buffers" + "".join(f", {name!r}" for name in entry["copied"])
        said.append(f"the DDP replicas of {called(entry)} had drifted apart: {how}; every rank now holds rank 0's "
                    f"{copied}")
    return "the warm pool's ranks are back, but " + "; ".join(said) + \
        ". The ranks keep their other names as they were"
