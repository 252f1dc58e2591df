"""What a run's reports come to, owned by the run: its reduced history, each rank's timings, its callbacks.

Every job (and every run followed through its files) has one :class:`Metrics`, made with it and listening to
its events first, however it was started: the front door, the engine alone, a warm pool.  It reduces the
ranks' ``metric`` events into ``job.history`` (:class:`~ddp_notebook.engine.history.Reducer`), keeps
``job.ranks`` (:class:`RankTimings`), sends each reduced record to the job's callbacks (``--callback``,
TensorBoard, W&B) and settles records that wait for ranks which never report them.  Views do none of this:
they :meth:`~Metrics.subscribe` and draw what they are told.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Iterable, Protocol

from ..wire import protocol
from .callbacks import Forwarder
from .history import History, Reducer

STRAGGLER_GAP = 0.10  # the others wait this much more of each step than the slowest rank: it is named


class Subscriber(Protocol):
    """What a view of a run's metrics implements (the notebook's dashboard does)."""

    def metrics_updated(self, updates: list[dict]) -> None:
        """New reduced records (or more values of records already made), in the order they were made."""

    def metrics_restarted(self, reached: dict[str, float], attempt: int, attempts: int, cause: str) -> None:
        """The job runs again on fresh ranks; ``reached``: x key -> the highest x the failed attempt made."""

    def metrics_finished(self, updates: list[dict]) -> None:
        """The run has ended; the last records it completed."""


class RankTimings(dict):
    """``job.ranks``: rank -> where its time per batch went, from what its loader and DDP measured.

    Each value is a dict: ``batches``, ``samples_per_s``, ``data_wait`` and ``comm_wait`` (shares of its
    step time spent waiting for data and, in the gradient all-reduce, for the other ranks), ``compute``
    (the rest), ``memory`` (bytes) and ``memory_kind`` ("cuda peak allocated" on GPUs, else "resident").
    """

    def __init__(self):
        super().__init__()
        self._totals: dict[int, dict] = {}

    def add(self, rank: int, stats: dict) -> None:
        totals = self._totals.setdefault(rank, {"batches": 0, "samples": 0, "step_s": 0.0, "data_s": 0.0,
                                                "comm_s": 0.0})
        for name in totals:
            totals[name] += stats[name]
        step_s = totals["step_s"] or float("nan")
        data_wait, comm_wait = totals["data_s"] / step_s, totals["comm_s"] / step_s
        self[rank] = {"batches": totals["batches"], "samples_per_s": totals["samples"] / step_s,
                      "data_wait": data_wait, "comm_wait": comm_wait,
                      "compute": max(0.0, 1.0 - data_wait - comm_wait),
                      "memory": stats["memory"], "memory_kind": stats["memory_kind"]}

    def straggler(self) -> tuple[int, str] | None:
        """The rank the others wait for in the all-reduce, and a line that says why; None if none stands out."""
        if len(self) < 2:
            return None
        slowest = min(self, key=lambda rank: self[rank]["comm_wait"])
        others = [self[rank]["comm_wait"] for rank in self if rank != slowest]
        waited = sum(others) / len(others)
        if waited - self[slowest]["comm_wait"] < STRAGGLER_GAP:
            return None
        own = self[slowest]
        line = f"rank {slowest}: the others wait {waited:.0%} of each step for it; "
        if own["data_wait"] >= 0.3:
            line += f"{own['data_wait']:.0%} of its own time is waiting for data: raise num_workers"
        else:
            line += f"it computes {own['compute']:.0%} of its step (data wait {own['data_wait']:.0%})"
        return slowest, line

    def lines(self) -> list[str]:
        """The compact per-rank panel of a dashboard's status."""
        if not self:
            return []
        lines = [f"rank {rank}: {s['samples_per_s']:.0f} samples/s · data wait {s['data_wait']:.0%} · "
                 f"waits for others {s['comm_wait']:.0%} · {s['memory'] / 2**20:.0f} MiB {s['memory_kind']}"
                 for rank, s in sorted(self.items())]
        straggler = self.straggler()
        lines.append(f"straggler: {straggler[1]}" if straggler else "straggler: none (the ranks keep pace)")
        return lines


class Metrics:
    """One run's metrics: a listener of its events (``source.add_listener(metrics)``, before any view's).

    ``lock`` guards the reducer and the history against readers on other threads (a view drawing them holds it
    too); subscribers are told in the order the updates were made, from whichever thread made them (the job's,
    or the timer that settles a record whose last reporters never came).
    """

    def __init__(self, world_size: int, callbacks: Iterable[Any] = ()):
        self.history = History()
        self.ranks = RankTimings()
        self.reducer = Reducer(world_size, self.history)
        self.lock = threading.Lock()
        self.ended = False
        self._forwarder = Forwarder(callbacks)
        self._subscribers: list[Subscriber] = []
        self._forwarding = threading.RLock()  # updates reach callbacks and subscribers in order, from either thread
        self._settle_timer: threading.Timer | None = None
        self._warned = False

    def subscribe(self, subscriber: Subscriber) -> bool:
        """Tell ``subscriber`` of every update from now on; False (and nothing subscribed) once the run has ended."""
        with self._forwarding:
            if self.ended:
                return False
            self._subscribers.append(subscriber)
            return True

    def __call__(self, source, kind: str, rank: int, body: dict) -> None:
        try:
            if kind == protocol.METRIC:
                self._reports(rank, body["reports"], body.get("rank_stats"))
            elif kind == protocol.RESTARTED:
                self._restarted(body)
            elif kind == protocol.ENDED:
                self._ended()
        except Exception as exc:  # noqa: BLE001 - metrics must never break the job
            if not self._warned:
                self._warned = True
                print(f"ddp_notebook: the metrics failed on a {kind!r} event: {exc!r}", file=sys.stderr)

    def _reports(self, rank: int, reports: list, rank_stats: dict | None) -> None:
        if not reports and rank_stats is None:  # (a rank's batch that found its reports taken by the one before)
            return
        with self._forwarding:
            with self.lock:
                updates = self.reducer.add_many(rank, reports)
                if rank_stats is not None:
                    self.ranks.add(rank, rank_stats)
                notices, self.reducer.notices = self.reducer.notices, []
                self._schedule_settle()
            self._forward(updates)
        for notice in notices:  # said once, in the cell
            print(f"ddp_notebook: {notice}", file=sys.stderr)

    def _forward(self, updates: list[dict]) -> None:
        """(Under ``_forwarding``.)"""
        self._forwarder.send(updates)
        for subscriber in list(self._subscribers):
            subscriber.metrics_updated(updates)

    def _schedule_settle(self) -> None:
        """(Under the lock.)  A metric waits for ranks that have not reported it yet: settle it when its wait
        is over even if no report comes then (a rank-0-only report once an epoch)."""
        delay = self.reducer.settles_in()
        if delay is None or self._settle_timer is not None or self.ended:
            return
        self._settle_timer = threading.Timer(delay + 0.01, self._settle_due)
        self._settle_timer.daemon = True
        self._settle_timer.start()

    def _settle_due(self) -> None:
        with self._forwarding:
            with self.lock:
                self._settle_timer = None
                if self.ended:
                    return
                updates = self.reducer.settle()
                self._schedule_settle()
            if updates:
                self._forward(updates)

    def _restarted(self, body: dict) -> None:
        """An attempt failed and the job runs again on fresh ranks: the history marks where it had come to."""
        with self._forwarding:
            with self.lock:
                reached = self.reducer.reached()
                self.reducer.new_attempt()
                self.history.attempts.append({"attempt": body["attempt"] - 1, "cause": body["cause"],
                                              "at": reached})
            for subscriber in list(self._subscribers):
                subscriber.metrics_restarted(reached, body["attempt"], body["attempts"], body["cause"])

    def _ended(self) -> None:
        with self._forwarding:
            with self.lock:
                if self._settle_timer is not None:
                    self._settle_timer.cancel()
                    self._settle_timer = None
                updates = self.reducer.finish()
                self.ended = True
            self._forwarder.send(updates)
            self._forwarder.close()
            subscribers, self._subscribers = self._subscribers, []
            for subscriber in subscribers:
                subscriber.metrics_finished(updates)
