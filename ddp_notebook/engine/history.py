"""Notebook side: reduce the ranks' reports into a history of global values.

Each x value (epoch or step) becomes one record, reduced over the ranks that
report: the mean weighted by ``n`` (1 where not given), or the sum for metrics
sent as ``Sum``.

Who reports a metric is learned.  A metric is held back for an x until every
rank has reported it there, so a curve never shows one rank's value as the
global one, until ``SETTLE_S`` after the metric was first reported: then the
ranks that have reported it so far are its reporters (``if rank == 0:
report(...)``: rank 0 alone), and each x is released as soon as they all have
sent it, reduced over them.  A rank that starts reporting a metric later joins
its reporters from there on (the reducer says so once in ``notices``: the
values before were reduced without it).  What is still held back when every
reporter has moved past that x, or when the job ends, is released with what
arrived, and the record names it under ``"partial"`` when a reporter is missing.
"""
from __future__ import annotations

import csv
import time
from collections import OrderedDict
from typing import Any

from ..wire.protocol import TOTAL_KEYS

SETTLE_S = 2.0  # how long a metric waits for ranks that never reported it before it is reduced without them


class History(list):
    """The reduced records of a job, one dict per x value, in the order they were completed.

    ``by_rank[i]`` holds each rank's own values behind record ``i``, before reduction:
    ``{name: {rank: value}}``.  ``reporters`` names the metrics that only some ranks report, with those ranks
    (``{"loss": [0]}`` for ``if rank == 0: report(loss=...)``): their values are reduced over those ranks alone.
    ``attempts`` lists the attempts that failed and were restarted (``--max-restarts``): ``{"attempt", "cause",
    "at"}`` with ``at`` the x values reached (``{"epoch": 3}``).
    A restarted attempt's records replace the failed attempt's for the x values it replays.
    """

    def __init__(self, *records):
        super().__init__(*records)
        self.by_rank: list[dict[str, dict[int, float]]] = [{} for _ in self]
        self.attempts: list[dict] = []
        self.reporters: dict[str, list[int]] = {}

    def to_csv(self, path: str) -> None:
        """Write the records as CSV, one column per key ever seen (empty where a record lacks it)."""
        columns: dict[str, None] = {}
        for record in self:
            columns.update(dict.fromkeys(record))
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(self)


class _Point:
    """What has arrived for one x value and not been closed yet."""

    __slots__ = ("ranks", "values", "released", "meta")

    def __init__(self):
        self.ranks: set[int] = set()
        self.values: dict[str, dict[int, tuple[float, float]]] = {}  # name -> rank -> (value, weight)
        self.released: dict[str, int] = {}  # name -> how many ranks' values its record holds
        self.meta: dict[str, Any] = {}


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


class Reducer:
    """Turns ``metric`` events into :class:`History` records.

    ``add``, ``settle`` and ``finish`` return the updates they made, each a dict
    with the x key and the newly reduced values, which is what callbacks are sent.
    ``notices`` collects what the user should be told once (a rank that started
    reporting a metric after its reporters were settled without it).
    """

    def __init__(self, world_size: int, history: History | None = None, clock=time.monotonic):
        self.world_size = world_size
        self.history = history if history is not None else History()
        self.clock = clock
        self.summed: set[str] = set()
        self.totals: dict[str, float] = {}  # x key -> total (epochs, steps)
        self.counts: dict[str, int] = {}  # x key -> records made
        self.notices: list[str] = []
        self._all = frozenset(range(world_size))
        self._pending: dict[str, OrderedDict] = {}  # x key -> x -> _Point
        self._latest: dict[str, dict[int, float]] = {}  # x key -> rank -> highest x it reported
        self._records: dict[tuple[str, float], dict] = {}  # (x key, x) -> its record in history
        self._own: dict[tuple[str, float], dict] = {}  # (x key, x) -> its ranks' own values (history.by_rank)
        self._stale: set[tuple[str, float]] = set()  # records of a failed attempt, replaced when replayed
        self._orphans: dict[str, dict[float, _Point]] = {}  # x key -> x -> what a failed attempt left unfinished
        self._senders: dict[tuple[str, str], set[int]] = {}  # (x key, name) -> the ranks that reported it so far
        self._names: dict[str, list[str]] = {}  # x key -> the names reported with it
        self._deadlines: dict[tuple[str, str], float] = {}  # (x key, name) -> when its reporters settle
        self._next_deadline = float("inf")
        self._settled: set[tuple[str, str]] = set()  # its reporters are its senders (else: every rank)
        self._told: set[str] = set()  # names a notice was given for
        self._key_ranks_of: dict[str, frozenset] = {}  # _key_ranks, until reporters change

    def add(self, rank: int, body: dict) -> list[dict]:
        """Take one rank's report; the updates it completed."""
        key, x = body["key"], body["x"]
        now = self.clock()
        updates = self.settle(now) if now >= self._next_deadline else []
        if body.get("total") is not None:
            self.totals[key] = body["total"]
        if body.get("sum"):
            self.summed.update(body["sum"])
        updates += self._settle_orphans(key, x)
        pending = self._pending.setdefault(key, OrderedDict())
        point = pending.get(x)
        values = body["values"]
        if point is None:
            record = self._records.get((key, x))
            if record is not None and (key, x) not in self._stale:
                late = [name for name in values if name in record]
                if late:  # that x was closed without this rank: its record stands
                    self._tell(late[0], f"rank {rank}'s {', '.join(late)} for {key} {x} arrived after that {key} "
                                        f"was complete without it and {'was' if len(late) == 1 else 'were'} "
                                        f"left out")
                    values = {name: value for name, value in values.items() if name not in record}
            point = pending[x] = _Point()
        point.ranks.add(rank)
        weight = 1.0 if body.get("n") is None else float(body["n"])
        for name, value in values.items():
            senders = self._senders.get((key, name))
            if senders is None or rank not in senders:
                self._new_sender(key, name, rank, x, now)
            point.values.setdefault(name, {})[rank] = (value, weight)
        if "epoch" in body:
            point.meta["epoch"] = body["epoch"]
        updates += self._release(key, x, point, final=False)

        latest = self._latest.setdefault(key, {})
        if x > latest.get(rank, float("-inf")):
            latest[rank] = x
            updates += self._close_passed(key)
        return updates

    def _new_sender(self, key: str, name: str, rank: int, x: float, now: float) -> None:
        ident = (key, name)
        senders = self._senders.get(ident)
        if senders is None:
            senders = self._senders[ident] = set()
            self._names.setdefault(key, []).append(name)
            self._deadlines[ident] = now + SETTLE_S
            self._next_deadline = min(self._next_deadline, now + SETTLE_S)
        if ident in self._settled:
            self._tell(name, f"rank {rank} started reporting {name} at {key} {x}, which {_ranks_text(senders)} "
                             f"alone had reported for {SETTLE_S:g} s or more: the {key}s before are reduced over "
                             f"{_ranks_text(senders)} alone")
        senders.add(rank)
        self._key_ranks_of.clear()
        if len(senders) == self.world_size and ident in self._deadlines:
            del self._deadlines[ident]  # every rank reports it: nothing to wait for
            self._settled.add(ident)
        if ident in self._settled:
            self._label(name)

    def _tell(self, name: str, notice: str) -> None:
        if name not in self._told:
            self._told.add(name)
            self.notices.append(notice)

    def _label(self, name: str) -> None:
        ranks = set().union(*(self._senders[(key, name)] for key in self._names
                              if (key, name) in self._settled))
        reporters = getattr(self.history, "reporters", None)  # a History's (a plain list has none)
        if reporters is None:
            return
        if len(ranks) < self.world_size:
            reporters[name] = sorted(ranks)
        else:
            reporters.pop(name, None)

    def settles_in(self, now: float | None = None) -> float | None:
        """Seconds until some metric's reporters settle (call :meth:`settle` then); None if none waits."""
        if not self._deadlines:
            return None
        return max(0.0, self._next_deadline - (self.clock() if now is None else now))

    def settle(self, now: float | None = None) -> list[dict]:
        """Settle the reporters of the metrics first reported ``SETTLE_S`` ago or more: those that have
        reported them so far.  Releases what they completed."""
        now = self.clock() if now is None else now
        due = [ident for ident, at in self._deadlines.items() if at <= now]
        keys = []
        for ident in due:
            del self._deadlines[ident]
            self._settled.add(ident)
            self._key_ranks_of.clear()
            self._label(ident[1])
            if ident[0] not in keys:
                keys.append(ident[0])
        self._next_deadline = min(self._deadlines.values(), default=float("inf"))
        updates = []
        for key in keys:
            for x, point in list(self._pending.get(key, {}).items()):
                updates += self._release(key, x, point, final=False)
            updates += self._close_passed(key)
        return updates

    def _key_ranks(self, key: str) -> frozenset | set:
        """The ranks expected to report x values of ``key``: every rank until all its metrics' reporters settle."""
        ranks = self._key_ranks_of.get(key)
        if ranks is None:
            names = self._names.get(key)
            if not names or any((key, name) not in self._settled for name in names):
                ranks = self._all
            else:
                ranks = frozenset().union(*(self._senders[(key, name)] for name in names))
            self._key_ranks_of[key] = ranks
        return ranks

    def _close_passed(self, key: str) -> list[dict]:
        """Release what is still held back for x values every expected rank has moved past."""
        pending = self._pending.get(key)
        latest = self._latest.get(key, {})
        ranks = self._key_ranks(key)
        if not pending or len(latest) < len(ranks) or not ranks <= latest.keys():
            return []
        floor = min(latest[rank] for rank in ranks)
        if next(iter(pending)) >= floor:
            return []
        updates = []
        while pending:
            oldest = next(iter(pending))
            if oldest >= floor:
                break
            updates += self._release(key, oldest, pending.pop(oldest), final=True)
        return updates

    def reached(self) -> dict[str, float]:
        """Per x key, where the ranks were: one past the highest x any rank reported (the one under way)."""
        reached = {}
        for key, latest in self._latest.items():
            seen = [x for (k, x) in self._records if k == key] + list(latest.values())
            reached[key] = max(seen) + 1
        return reached

    def new_attempt(self) -> None:
        """The job restarts on fresh ranks.  Its records stay until the new attempt replays their x values; what
        the failed attempt left unfinished is dropped where the new attempt replays it, and released as partial
        where it does not (its first report lies beyond, or the job ends)."""
        for key, pending in self._pending.items():
            self._orphans.setdefault(key, {}).update(pending)
            pending.clear()
        self._latest.clear()
        self._stale = set(self._records)

    def _settle_orphans(self, key: str, x: float) -> list[dict]:
        orphans = self._orphans.get(key)
        if not orphans:
            return []
        updates = []
        for old_x in sorted(orphans):
            if old_x >= x:
                if old_x == x:
                    del orphans[old_x]  # replayed: the new attempt's values will stand
                break
            self._stale.discard((key, old_x))  # not replayed: what the failed attempt reduced of it stays
            updates += self._release(key, old_x, orphans.pop(old_x), final=True)
        return updates

    def finish(self) -> list[dict]:
        """The job ended: release everything still held back, marked partial where reporters are missing."""
        updates = self.settle(float("inf"))
        for key, orphans in self._orphans.items():
            for x in sorted(orphans):
                self._stale.discard((key, x))
                updates += self._release(key, x, orphans[x], final=True)
            orphans.clear()
        for key, pending in self._pending.items():
            for x in sorted(pending):
                updates += self._release(key, x, pending[x], final=True)
            pending.clear()
        return updates

    def _reduce(self, name: str, by_rank: dict[int, tuple[float, float]]) -> float:
        pairs = [by_rank[r] for r in sorted(by_rank)]
        if name in self.summed:
            return sum(value for value, _ in pairs)
        total_weight = sum(weight for _, weight in pairs)
        if total_weight == 0:
            return sum(value for value, _ in pairs) / len(pairs)
        return sum(value * weight for value, weight in pairs) / total_weight

    def _release(self, key: str, x: float, point: _Point, final: bool) -> list[dict]:
        if not final and point.values:  # the common case first: is anything new complete?
            for name, by_rank in point.values.items():
                if point.released.get(name) != len(by_rank) and len(by_rank) >= (
                        len(self._senders[(key, name)]) if (key, name) in self._settled else self.world_size):
                    break
            else:
                return []
        reduced, partial = {}, []
        own: dict[str, dict[int, float]] = {}
        for name, by_rank in point.values.items():
            if point.released.get(name) == len(by_rank):
                continue  # its record holds all that arrived
            ident = (key, name)
            senders = self._senders[ident]
            complete = by_rank.keys() >= (senders if ident in self._settled else self._all)
            if complete or final:
                reduced[name] = self._reduce(name, by_rank)
                own[name] = {rank: value for rank, (value, _) in sorted(by_rank.items())}
                point.released[name] = len(by_rank)
                if not by_rank.keys() >= senders:
                    partial.append(name)
        record = self._records.get((key, x))
        if (key, x) in self._stale and reduced:  # replayed by a restarted attempt: its values replace the old
            self._stale.discard((key, x))
            for name in [n for n in record if n not in (key, TOTAL_KEYS.get(key))]:
                del record[name]
            self._own[(key, x)].clear()
        if record is None:
            if not (reduced or final or (not point.values and point.ranks >= self._key_ranks(key))):
                return []
            record = {key: x}
            if key in self.totals:
                record[TOTAL_KEYS[key]] = self.totals[key]
            self._records[(key, x)] = record
            self.history.append(record)
            self._own[(key, x)] = {}
            if isinstance(self.history, History):
                self.history.by_rank.append(self._own[(key, x)])
            self.counts[key] = self.counts.get(key, 0) + 1
        elif not reduced:
            return []
        update = {key: x, **point.meta, **reduced}
        earlier = record["partial"].split(",") if record.get("partial") else []
        # A value reduced again with a late rank's may be complete now: partial names only what still is.
        marked = [name for name in earlier if name not in reduced or name in partial]
        marked += [name for name in partial if name not in marked]
        if marked and (partial or marked != earlier):
            update["partial"] = ",".join(marked)
        elif not marked and earlier:
            del record["partial"]
        record.update(update)
        self._own[(key, x)].update(own)
        point.meta = {}
        return [update]
