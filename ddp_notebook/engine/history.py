"""Notebook side: reduce the ranks' reports into a history of global values.

Each x value (epoch or step) becomes one record, reduced over all ranks: the
mean weighted by ``n`` (1 where not given), or the sum for metrics sent as
``Sum``.  A metric is held back until every rank has reported it for that x, so
a curve never shows one rank's value as the global one.  What is still held
back when every rank has moved past that x, or when the job ends, is released
with what arrived and the record names it under ``"partial"``.
"""
from __future__ import annotations

import csv
from collections import OrderedDict
from typing import Any

from ..wire.protocol import TOTAL_KEYS


class History(list):
    """The reduced records of a job, one dict per x value, in the order they were completed.

    ``attempts`` lists the attempts that failed and were restarted (``--max-restarts``): ``{"attempt", "cause",
    "at"}`` with ``at`` the x values reached (``{"epoch": 3}``).  A restarted attempt's records replace the
    failed attempt's for the x values it replays.
    """

    def __init__(self, *args):
        super().__init__(*args)
        self.attempts: list[dict] = []

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
    """What has arrived for one x value and not been released yet."""

    __slots__ = ("ranks", "values", "meta")

    def __init__(self):
        self.ranks: set[int] = set()
        self.values: dict[str, dict[int, tuple[float, float]]] = {}  # name -> rank -> (value, weight)
        self.meta: dict[str, Any] = {}


class Reducer:
    """Turns ``metric`` events into :class:`History` records.

    ``add`` and ``finish`` return the updates they made, each a dict with the x
    key and the newly reduced values, which is what callbacks are sent.
    """

    def __init__(self, world_size: int, history: History | None = None):
        self.world_size = world_size
        self.history = history if history is not None else History()
        self.summed: set[str] = set()
        self.totals: dict[str, float] = {}  # x key -> total (epochs, steps)
        self.counts: dict[str, int] = {}  # x key -> records made
        self._pending: dict[str, OrderedDict] = {}  # x key -> x -> _Point
        self._latest: dict[str, dict[int, float]] = {}  # x key -> rank -> highest x it reported
        self._records: dict[tuple[str, float], dict] = {}  # (x key, x) -> its record in history
        self._stale: set[tuple[str, float]] = set()  # records of a failed attempt, replaced when replayed
        self._orphans: dict[str, dict[float, _Point]] = {}  # x key -> x -> what a failed attempt left unfinished

    def add(self, rank: int, body: dict) -> list[dict]:
        """Take one rank's report; the updates it completed."""
        key, x = body["key"], body["x"]
        if body.get("total") is not None:
            self.totals[key] = body["total"]
        if body.get("sum"):
            self.summed.update(body["sum"])
        orphaned = self._settle_orphans(key, x)
        pending = self._pending.setdefault(key, OrderedDict())
        point = pending.get(x)
        if point is None:
            point = pending[x] = _Point()
        point.ranks.add(rank)
        weight = 1.0 if body.get("n") is None else float(body["n"])
        for name, value in body["values"].items():
            point.values.setdefault(name, {})[rank] = (value, weight)
        if "epoch" in body:
            point.meta["epoch"] = body["epoch"]
        updates = orphaned + self._release(key, x, point, final=False)

        latest = self._latest.setdefault(key, {})
        if x > latest.get(rank, float("-inf")):
            latest[rank] = x
            if len(latest) == self.world_size:
                # Every rank is past these x values: nothing more will come for them.
                floor = min(latest.values())
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
        """The job ended: release everything still held back, marked partial where ranks are missing."""
        updates = []
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
        if not final and len(point.ranks) < self.world_size:
            return []
        reduced, partial = {}, []
        for name in list(point.values):
            by_rank = point.values[name]
            if len(by_rank) == self.world_size or final:
                reduced[name] = self._reduce(name, by_rank)
                if len(by_rank) < self.world_size:
                    partial.append(name)
                del point.values[name]
        record = self._records.get((key, x))
        if (key, x) in self._stale and reduced:  # replayed by a restarted attempt: its values replace the old
            self._stale.discard((key, x))
            for name in [n for n in record if n not in (key, TOTAL_KEYS.get(key))]:
                del record[name]
        if record is None:
            record = {key: x}
            if key in self.totals:
                record[TOTAL_KEYS[key]] = self.totals[key]
            self._records[(key, x)] = record
            self.history.append(record)
            self.counts[key] = self.counts.get(key, 0) + 1
        elif not reduced:
            return []
        update = {key: x, **point.meta, **reduced}
        if partial:
            earlier = record.get("partial")
            update["partial"] = ",".join(([earlier] if earlier else []) + partial)
        record.update(update)
        point.meta = {}
        return [update]
