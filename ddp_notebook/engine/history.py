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

The history of a long run (``report()`` every step for hours) is kept in
columns, about 9 bytes per value, not as a dict per record (about 1 kB each
with the ranks' own values): a record is made when it is read.
"""
from __future__ import annotations

import bisect
import csv
import time
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..wire.protocol import TOTAL_KEYS, expand_reports

SETTLE_S = 2.0  # how long a metric waits for ranks that never reported it before it is reduced without them

_ABSENT, _FLOAT, _INT, _TEXT, _OTHER = range(5)  # how a column holds one record's value
_EXACT_INT = 2 ** 53  # ints up to this size are exact as floats
_FLOATS, _INTS = bytes((_FLOAT,)), bytes((_INT,))


class _Column:
    """One field's values over the records: a float each (8 bytes) and how to read it back (1 byte).

    Floats are kept as they are (nan, -0.0 included), ints up to 2**53 as floats read back as ints, strings as
    a code into the column's own list of them (``partial`` repeats a few names), anything else as itself.
    """

    __slots__ = ("values", "kinds", "texts", "text_codes", "others")

    def __init__(self):
        self.values = array("d")
        self.kinds = bytearray()
        self.texts: list[str] = []
        self.text_codes: dict[str, int] = {}
        self.others: dict[int, Any] = {}

    def set(self, index: int, value: Any) -> None:
        kinds = self.kinds
        if index == len(kinds):  # the common case: the next record's number
            kind = type(value)
            if kind is float:
                self.values.append(value)
                kinds.append(_FLOAT)
                return
            if kind is int and -_EXACT_INT <= value <= _EXACT_INT:
                self.values.append(value)
                kinds.append(_INT)
                return
        if index >= len(kinds):  # records added since this column was last set hold nothing in it
            missing = index + 1 - len(kinds)
            kinds.extend(bytes(missing))
            self.values.frombytes(bytes(8 * missing))
        elif kinds[index] == _OTHER:
            del self.others[index]
        kind = type(value)
        if kind is float:
            self.values[index] = value
            kinds[index] = _FLOAT
        elif kind is int and -_EXACT_INT <= value <= _EXACT_INT:
            self.values[index] = value
            kinds[index] = _INT
        elif kind is str:
            code = self.text_codes.get(value)
            if code is None:
                code = self.text_codes[value] = len(self.texts)
                self.texts.append(value)
            self.values[index] = code
            kinds[index] = _TEXT
        else:  # huge ints, bools, anything a history was built from
            self.others[index] = value
            kinds[index] = _OTHER

    def extend(self, index: int, values: list) -> None:
        """``set`` for records ``index``, ``index + 1``, ... in turn."""
        if index == len(self.kinds):
            if all(type(value) is float for value in values):
                self.values.extend(values)
                self.kinds.extend(_FLOATS * len(values))
                return
            if all(type(value) is int and -_EXACT_INT <= value <= _EXACT_INT for value in values):
                self.values.extend(values)
                self.kinds.extend(_INTS * len(values))
                return
        for offset, value in enumerate(values):
            self.set(index + offset, value)

    def get(self, index: int) -> Any:
        kind = self.kinds[index]
        if kind == _FLOAT:
            return self.values[index]
        if kind == _INT:
            return int(self.values[index])
        if kind == _TEXT:
            return self.texts[int(self.values[index])]
        return self.others[index]

    def forget(self, index: int) -> None:
        if index < len(self.kinds):
            if self.kinds[index] == _OTHER:
                del self.others[index]
            self.kinds[index] = _ABSENT


def _column(columns: dict, ident) -> _Column:
    """The column of ``ident`` (a name, or (name, rank)), made empty where there is none yet."""
    column = columns.get(ident)
    if column is None:
        column = columns[ident] = _Column()
    return column


class _Layouts:
    """The distinct shapes of the records (their fields, in order), each named by a small code.

    A record stores its shape's code (4 bytes) and its values in the columns; a run has a handful of shapes.
    """

    def __init__(self):
        self.shapes: list[tuple] = [()]
        self.codes: dict[tuple, int] = {(): 0}
        self.of = array("I")  # record -> its shape's code
        self._grown: dict[tuple[int, tuple], int] = {}  # (code, fields set) -> the code after setting them

    def code(self, shape: tuple) -> int:
        code = self.codes.get(shape)
        if code is None:
            code = self.codes[shape] = len(self.shapes)
            self.shapes.append(shape)
        return code

    def grown(self, code: int, fields: tuple) -> int:
        """The shape after setting ``fields`` (dict.update's order: the new ones at the end)."""
        ident = (code, fields)
        grown = self._grown.get(ident)
        if grown is None:
            shape = self.shapes[code]
            grown = self._grown[ident] = self.code(shape + tuple(f for f in fields if f not in shape))
        return grown


class ByRank(Sequence):
    """``history.by_rank``: each rank's own values behind each record, before reduction.

    ``by_rank[i]`` is ``{name: {rank: value}}`` for record ``i``, made when read.
    """

    def __init__(self, history: "History"):
        self._history = history

    def __len__(self) -> int:
        return len(self._history)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._history._own(i) for i in range(*index.indices(len(self)))]
        return self._history._own(_position(index, len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (ByRank, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))


def _position(index, length: int) -> int:
    index = index.__index__()
    if index < 0:
        index += length
    if not 0 <= index < length:
        raise IndexError("history index out of range")
    return index


def _read_only(name: str):
    def refuse(self, *args, **kwargs):
        raise TypeError(f"History.{name}(): a job's history is filled by the job alone; "
                        f"list(job.history) is a list of its records to change")
    refuse.__name__ = name
    return refuse


class History(list):
    """The reduced records of a job, one dict per x value, in the order they were completed.

    It reads as a list of dicts (index, slice, iterate, ``len``, compare with a list, ``json.dumps``,
    ``pandas.DataFrame(history)``); each record is made when read, from columns that hold a long run compactly,
    so changing a record read from it changes nothing, and the history itself is filled by the job alone.

    ``by_rank[i]`` holds each rank's own values behind record ``i``, before reduction:
    ``{name: {rank: value}}``.  ``reporters`` names the metrics that only some ranks report, with those ranks
    (``{"loss": [0]}`` for ``if rank == 0: report(loss=...)``): their values are reduced over those ranks alone.
    ``attempts`` lists the attempts that failed and were restarted (``--max-restarts``): ``{"attempt", "cause",
    "at"}`` with ``at`` the x values reached (``{"epoch": 3}``).  A restarted attempt's records replace the
    failed attempt's for the x values it replays.
    """

    def __init__(self, records=()):
        super().__init__()
        self._count = 0
        self._columns: dict[str, _Column] = {}
        self._layouts = _Layouts()
        self._own_columns: dict[tuple[str, int], _Column] = {}
        self._own_layouts = _Layouts()  # shapes of by_rank: ((name, (rank, ...)), ...)
        self.by_rank = ByRank(self)
        self.attempts: list[dict] = []
        self.reporters: dict[str, list[int]] = {}
        for record in records:
            self._update(self._append(), record)

    # -- reading: a list of dicts -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._record(i) for i in range(*index.indices(self._count))]
        return self._record(_position(index, self._count))

    def __iter__(self):
        for index in range(self._count):
            yield self._record(index)

    def __reversed__(self):
        for index in range(self._count - 1, -1, -1):
            yield self._record(index)

    def __contains__(self, record) -> bool:
        return any(mine == record for mine in self)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))

    def __add__(self, other) -> list:
        return list(self) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self)

    def __mul__(self, times: int) -> list:
        return list(self) * times

    __rmul__ = __mul__

    def __reduce__(self):
        return _rebuild, (list(self), list(self.by_rank), self.attempts, self.reporters)

    def __sizeof__(self) -> int:
        columns = list(self._columns.values()) + list(self._own_columns.values())
        return (object.__sizeof__(self) + self._layouts.of.buffer_info()[1] * 4
                + self._own_layouts.of.buffer_info()[1] * 4
                + sum(c.values.buffer_info()[1] * 8 + len(c.kinds) for c in columns))

    def copy(self) -> list:
        """The records as a plain list of dicts."""
        return list(self)

    def index(self, record, start: int = 0, stop: int | None = None) -> int:
        for position in range(*slice(start, stop).indices(self._count)):
            if self._record(position) == record:
                return position
        raise ValueError("record is not in the history")

    def count(self, record) -> int:
        return sum(1 for mine in self if mine == record)

    append, extend, insert = _read_only("append"), _read_only("extend"), _read_only("insert")
    pop, remove, clear = _read_only("pop"), _read_only("remove"), _read_only("clear")
    sort, reverse = _read_only("sort"), _read_only("reverse")
    __setitem__, __delitem__ = _read_only("__setitem__"), _read_only("__delitem__")
    __iadd__, __imul__ = _read_only("__iadd__"), _read_only("__imul__")

    def to_csv(self, path: str) -> None:
        """Write the records as CSV, one column per key ever seen (empty where a record lacks it)."""
        columns: dict[str, None] = {}
        for shape in self._layouts.shapes:
            columns.update(dict.fromkeys(shape))
        with open(path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(self)

    def _record(self, index: int) -> dict:
        columns = self._columns
        return {name: columns[name].get(index) for name in self._layouts.shapes[self._layouts.of[index]]}

    def _own(self, index: int) -> dict[str, dict[int, Any]]:
        columns = self._own_columns
        return {name: {rank: columns[(name, rank)].get(index) for rank in ranks}
                for name, ranks in self._own_layouts.shapes[self._own_layouts.of[index]]}

    # -- writing: the reducer's ---------------------------------------------------------------------------------
    def _append(self) -> int:
        """A new, empty record at the end; its index."""
        self._layouts.of.append(0)
        self._own_layouts.of.append(0)
        self._count += 1
        return self._count - 1

    def _append_record(self, record: dict, own: dict[str, dict[int, Any]]) -> int:
        """A new record at the end, with its by-rank values; its index."""
        index = self._append()
        self._update(index, record)
        self._update_own(index, own)
        return index

    def _append_records(self, fields: tuple, columns: list[list], own: dict[tuple[str, int], list],
                        own_shape: tuple, count: int) -> None:
        """``count`` new records at the end, alike: ``fields`` and a column of values each; by-rank values in
        columns by (name, rank), ``own_shape`` their shape."""
        index = self._count
        self._layouts.of.extend([self._layouts.code(fields)] * count)
        for name, values in zip(fields, columns):
            _column(self._columns, name).extend(index, values)
        self._own_layouts.of.extend([self._own_layouts.code(own_shape)] * count)
        for ident, values in own.items():
            _column(self._own_columns, ident).extend(index, values)
        self._count += count

    def _fields(self, index: int) -> tuple:
        return self._layouts.shapes[self._layouts.of[index]]

    def _get(self, index: int, name: str, default=None):
        return self._columns[name].get(index) if name in self._fields(index) else default

    def _update(self, index: int, values: dict) -> None:
        """``record.update(values)``."""
        layouts = self._layouts
        layouts.of[index] = layouts.grown(layouts.of[index], tuple(values))
        for name, value in values.items():
            _column(self._columns, name).set(index, value)

    def _remove(self, index: int, names) -> None:
        """``del record[name]`` for each of ``names`` it holds."""
        shape = self._fields(index)
        gone = [name for name in shape if name in names]
        for name in gone:
            self._columns[name].forget(index)
        if gone:
            self._layouts.of[index] = self._layouts.code(tuple(name for name in shape if name not in gone))

    def _update_own(self, index: int, own: dict[str, dict[int, Any]]) -> None:
        """``by_rank[index].update(own)``: each name's ranks and values replace the ones it had."""
        if not own:
            return
        layouts = self._own_layouts
        shape = dict(layouts.shapes[layouts.of[index]])
        columns = self._own_columns
        for name, by_rank in own.items():
            shape[name] = tuple(by_rank)
            for rank, value in by_rank.items():
                _column(columns, (name, rank)).set(index, value)
        layouts.of[index] = layouts.code(tuple(shape.items()))

    def _clear_own(self, index: int) -> None:
        for name, ranks in self._own_layouts.shapes[self._own_layouts.of[index]]:
            for rank in ranks:
                self._own_columns[(name, rank)].forget(index)
        self._own_layouts.of[index] = 0


def _rebuild(records, by_rank, attempts, reporters) -> History:
    history = History(records)
    for index, own in enumerate(by_rank):
        history._update_own(index, own)
    history.attempts, history.reporters = attempts, reporters
    return history


class _XIndex:
    """Which record holds each x value of one key: their indices, sorted by x (4 bytes a record).

    Reports mostly come with a new x past all others: that case is one comparison.
    """

    __slots__ = ("at", "last", "history", "key")

    def __init__(self, history: History, key: str):
        self.at = array("I")
        self.last: Any = None  # the highest x
        self.history, self.key = history, key

    def _place(self, x) -> int:
        """Where x belongs in ``at`` (before the records of equal x)."""
        at, history, key = self.at, self.history, self.key
        low, high = 0, len(at)
        while low < high:
            middle = (low + high) // 2
            if history._get(at[middle], key) < x:
                low = middle + 1
            else:
                high = middle
        return low

    def find(self, x) -> int | None:
        if not self.at or x > self.last:
            return None
        if x == self.last:
            return self.at[-1]
        position = self._place(x)
        if position < len(self.at) and self.history._get(self.at[position], self.key) == x:
            return self.at[position]
        return None

    def add(self, x, index: int) -> None:
        if not self.at or x > self.last:
            self.at.append(index)
            self.last = x
        else:
            self.at.insert(self._place(x), index)

    def highest(self):
        """The highest x that has a record (None without any)."""
        return self.last

    def lowest(self):
        """The lowest x that has a record (None without any)."""
        return self.history._get(self.at[0], self.key) if self.at else None



class _Point:
    """What has arrived for one x value and not been closed yet."""

    __slots__ = ("ranks", "values", "released", "meta", "index")

    def __init__(self):
        self.index: int | None = None  # its record in the history, once it has one
        self.ranks: set[int] = set()
        self.values: dict[str, dict[int, tuple[float, float]]] = {}  # name -> rank -> (value, weight)
        self.released: dict[str, int] = {}  # name -> how many ranks' values its record holds
        self.meta: dict[str, Any] = {}


class _Lane:
    """One x key's reports in the common case, kept apart from the general points, in columns.

    The case: every metric of the key has settled reporters, the same ranks for all, each report of theirs carries
    all of them (in one order) and no ``n`` or ``epoch``, and each rank reports the same x values, each once,
    rising.  Each rank's values wait in its columns until every rank has sent an x; the records of the x values
    every rank has sent are then made together, with the values and order the general path gives them (a run of
    reports, ``protocol.RUN``, goes in whole).  Anything else (a rank skipping an x, a late or repeated report,
    another metric, a weight, a rank or reporters changing, a restart, the job's end) first hands the lane back to
    the general path as the points it would hold (:meth:`Reducer._flush_lane`), and the general path goes on from
    there.
    """

    __slots__ = ("order", "names", "xs", "columns", "arrivals", "start", "done")

    def __init__(self, ranks: frozenset, names: tuple):
        self.order, self.names = tuple(sorted(ranks)), names
        self.xs: dict[int, list] = {rank: [] for rank in ranks}  # each rank's x values, from start on waiting
        self.columns: dict[int, list[list]] = {rank: [[] for _ in names] for rank in ranks}  # and its values
        self.arrivals: dict[int, list[int]] = {rank: [] for rank in ranks}  # and when each came (Reducer._arrivals)
        self.start: dict[int, int] = dict.fromkeys(ranks, 0)
        self.done: list[tuple] = []  # (xs, first record's index, rank -> columns): made, not closed yet

    def waiting(self, rank: int) -> int:
        return len(self.xs[rank]) - self.start[rank]

    def advance(self, rank: int, count: int) -> None:
        start = self.start[rank] = self.start[rank] + count
        if start > 4096 and 2 * start > len(self.xs[rank]):  # let go of what was taken
            del self.xs[rank][:start], self.arrivals[rank][:start]
            for column in self.columns[rank]:
                del column[:start]
            self.start[rank] = 0


def _reduce(summed: bool, pairs: list[tuple[float, float]]) -> float:
    """One x's value of a metric from the ranks' (value, weight) pairs, in rank order: their sum, or their mean
    weighted by ``n`` (plain where the weights add up to 0)."""
    if summed:
        return sum(value for value, _ in pairs)
    total_weight = sum(weight for _, weight in pairs)
    if total_weight == 0:
        return sum(value for value, _ in pairs) / len(pairs)
    return sum(value * weight for value, weight in pairs) / total_weight


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
        self._fractional: set[str] = set()  # the x keys reported with an x that is not a whole number
        self.notices: list[str] = []
        self._all = frozenset(range(world_size))
        self._pending: dict[str, OrderedDict] = {}  # x key -> x -> _Point
        self._latest: dict[str, dict[int, float]] = {}  # x key -> rank -> highest x it reported
        self._where: dict[str, _XIndex] = {}  # x key -> which record holds each x
        self._stale_below = 0  # the records before this index are a failed attempt's, replaced when replayed...
        self._fresh: set[int] = set()  # ...except these, replayed or kept since
        self._orphans: dict[str, dict[float, _Point]] = {}  # x key -> x -> what a failed attempt left unfinished
        self._senders: dict[tuple[str, str], set[int]] = {}  # (x key, name) -> the ranks that reported it so far
        self._names: dict[str, list[str]] = {}  # x key -> the names reported with it
        self._deadlines: dict[tuple[str, str], float] = {}  # (x key, name) -> when its reporters settle
        self._next_deadline = float("inf")
        self._settled: set[tuple[str, str]] = set()  # its reporters are its senders (else: every rank)
        self._told: set[str] = set()  # names a notice was given for
        self._key_ranks_of: dict[str, frozenset] = {}  # _key_ranks, until reporters change
        self._lanes: dict[str, _Lane] = {}  # x key -> its reports in the common case
        self._arrivals = 0  # reports taken so far (their order, for a lane handed back)

    def done(self, key: str) -> float:
        """How far the ``key`` axis has come, in the units of its total (``report(steps=...)``): the highest x that
        has a record, one more where whole x's begin at 0 (``report(step=0)`` is one step done), and never past the
        total (a baseline ``report(epoch=0)`` before epochs 1 to 10 is not 11 of 10). Reports made every k steps
        count k steps each, and a replayed x does not count twice."""
        where = self._where.get(key)
        last = where.highest() if where is not None else None
        if last is None:
            return 0
        done = last + 1 if where.lowest() == 0 and key not in self._fractional else last
        total = self.totals.get(key)
        return min(done, total) if total else done

    def _saw(self, key: str, xs) -> None:
        """Mark the key's axis fractional once an x is not a whole number (``report(epoch=0.5)``)."""
        if key not in self._fractional and not all(type(x) is int or float(x).is_integer() for x in xs):
            self._fractional.add(key)

    def add(self, rank: int, body: dict) -> list[dict]:
        """Take one rank's report; the updates it completed."""
        return self.add_many(rank, (body,))

    def add_many(self, rank: int, bodies) -> list[dict]:
        """Take one rank's reports, in the order it made them (a batch of its ``metric`` event: records, or runs of
        them, ``protocol.RUN``); the updates they completed.  What every rank has moved past is closed once, after
        the batch."""
        now = self.clock()
        updates = self.settle(now) if now >= self._next_deadline else []
        moved: list[str] = []  # the x keys whose ranks moved on
        for body in bodies:
            if type(body) is tuple:  # a run
                _, key, total, names, xs, columns = body
                if total is not None:
                    self.totals[key] = total
                self._saw(key, xs)
                if not self._orphans.get(key) and self._lane_take(rank, key, names, xs, columns, updates):
                    self._arrivals += len(xs)
                    self._moved(rank, key, xs[-1], moved)
                    continue
                for record in expand_reports((body,)):
                    self._take(rank, record, now, updates, moved)
            else:
                self._take(rank, body, now, updates, moved)
        for key in moved:
            updates += self._close_passed(key)
        return updates

    def _take(self, rank: int, body: dict, now: float, updates: list, moved: list) -> None:
        key, x = body["key"], body["x"]
        went_back = body.get("went_back")
        if went_back is not None:  # (counted on by the rank: rank/metrics.py)
            self._tell(f"{key} went back", f"rank {rank}'s {key} went back from {went_back[0]:g} to "
                                           f"{went_back[1]:g}: taken as a new pass, counted on from {key} {x:g} so "
                                           f"that every pass keeps its records; give report() a {key} that keeps "
                                           f"rising to number them yourself")
        self._saw(key, (x,))
        if body.get("total") is not None:
            self.totals[key] = body["total"]
        if body.get("sum"):
            self.summed.update(body["sum"])
        if self._orphans:
            updates += self._settle_orphans(key, x)
        values = body["values"]
        if (body.get("n") is not None or "epoch" in body or not values
                or not self._lane_take(rank, key, tuple(values), [x], [[value] for value in values.values()],
                                       updates)):
            updates += self._add_point(rank, key, x, body, now)
        self._arrivals += 1
        self._moved(rank, key, x, moved)

    def _moved(self, rank: int, key: str, x, moved: list) -> None:
        latest = self._latest.get(key)
        if latest is None:
            latest = self._latest[key] = {}
        if x > latest.get(rank, float("-inf")):
            latest[rank] = x
            if key not in moved:
                moved.append(key)

    def _add_point(self, rank: int, key: str, x, body: dict, now: float) -> list[dict]:
        """The general path: one report into the point of its x."""
        self._flush_lane(key)  # (the points a lane holds come first, as they came)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = OrderedDict()
        point = pending.get(x)
        values = body["values"]
        if point is None:
            index = self._record_of(key, x)
            if index is not None and not self._is_stale(index):
                fields = self.history._fields(index)
                late = [name for name in values if name in fields]
                if late:  # that x was closed without this rank: its record stands
                    self._tell(late[0], f"rank {rank}'s {', '.join(late)} for {key} {x} arrived after that "
                                        f"{key} was complete without it and "
                                        f"{'was' if len(late) == 1 else 'were'} left out")
                    values = {name: value for name, value in values.items() if name not in fields}
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
        return self._release(key, x, point, final=False)

    def _lane_take(self, rank: int, key: str, names: tuple, xs: list, columns: list, updates: list) -> bool:
        """Take a rank's reports (x values and a column of values a metric) in the key's lane (see :class:`_Lane`),
        adding the updates they complete to ``updates``; False where they are not the lane's case (its lane, if
        any, is handed back first)."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._open_lane(key, xs[0], names)
            if lane is None:
                return False
        mine = lane.xs.get(rank)
        if mine is None or names != lane.names:
            self._flush_lane(key)
            return False
        waiting = lane.waiting(rank)
        if waiting:
            last = mine[-1]
        else:
            where = self._where.get(key)
            last = where.last if where is not None and where.last is not None else float("-inf")
        fits = xs[0] > last and (len(xs) == 1 or all(a < b for a, b in zip(xs, xs[1:])))
        if fits:
            for other in lane.order:
                ahead = lane.waiting(other) - waiting
                if other != rank and ahead > 0:
                    overlap = min(len(xs), ahead)
                    at = lane.start[other] + waiting
                    if lane.xs[other][at:at + overlap] != xs[:overlap]:
                        fits = False  # the ranks' x values part: one skipped one
                        break
        if not fits:
            self._flush_lane(key)
            return False
        mine.extend(xs)
        for column, values in zip(lane.columns[rank], columns):
            column.extend(values)
        lane.arrivals[rank].extend(range(self._arrivals, self._arrivals + len(xs)))
        complete = min(map(lane.waiting, lane.order))
        if complete:
            updates += self._complete_lane(key, lane, complete)
        return True

    def _open_lane(self, key: str, x, names: tuple) -> _Lane | None:
        pending = self._pending.get(key)
        if pending and len(pending) > 1:  # (at most one x every rank reported stays open: the slowest rank's last)
            return None
        key_names = self._names.get(key)
        if (not names or self._orphans.get(key) or key_names is None or len(key_names) != len(names)
                or set(key_names) != set(names)):
            return None
        ranks = None
        for name in names:
            ident = (key, name)
            if ident not in self._settled:
                return None
            senders = self._senders[ident]
            if ranks is None:
                ranks = frozenset(senders)
            elif senders != ranks:
                return None
        where = self._where.get(key)
        if where is not None and where.last is not None and not x > where.last:
            return None
        for point in (pending or {}).values():  # a general point still open must be all released
            if point.index is None or any(point.released.get(name) != len(by_rank)
                                          for name, by_rank in point.values.items()):
                return None
        lane = self._lanes[key] = _Lane(ranks, names)
        return lane

    def _complete_lane(self, key: str, lane: _Lane, count: int) -> list[dict]:
        """The next ``count`` x values every rank has sent: their records, as the general path makes them."""
        order, names = lane.order, lane.names
        first = lane.start[order[0]]
        xs = lane.xs[order[0]][first:first + count]
        taken = {}
        for rank in order:
            at = lane.start[rank]
            taken[rank] = [column[at:at + count] for column in lane.columns[rank]]
            lane.advance(rank, count)
        summed = self.summed
        reduced = []
        for j, name in enumerate(names):
            by_rank = [taken[rank][j] for rank in order]
            total = name in summed
            reduced.append([_reduce(total, [(value, 1.0) for value in values]) for values in zip(*by_rank)])
        history = self.history
        index = len(history)
        total = self.totals.get(key)
        fields = (key,) if total is None else (key, TOTAL_KEYS[key])
        history._append_records(fields + names, [xs] + ([] if total is None else [[total] * count]) + reduced,
                                {(name, rank): taken[rank][j] for j, name in enumerate(names) for rank in order},
                                tuple((name, order) for name in names), count)
        where = self._where.get(key)
        if where is None:
            where = self._where[key] = _XIndex(history, key)
        where.at.extend(range(index, index + count))
        where.last = xs[-1]
        self.counts[key] = self.counts.get(key, 0) + count
        lane.done.append((xs, index, taken))
        heads = (key,) + names
        return [dict(zip(heads, row)) for row in zip(xs, *reduced)]

    def _flush_lane(self, key: str) -> None:
        """Hand the key's lane back to the general path: the points it would hold, in the order they came."""
        lane = self._lanes.pop(key, None)
        if lane is None:
            return
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = OrderedDict()
        names, order = lane.names, lane.order
        for xs, index, taken in lane.done:
            for i, x in enumerate(xs):
                point = pending[x] = _Point()
                point.index = index + i
                point.values = {name: {rank: (taken[rank][j][i], 1.0) for rank in order}
                                for j, name in enumerate(names)}
                point.ranks = set(order)
                point.released = dict.fromkeys(names, len(order))
        waiting = sorted((lane.arrivals[rank][i], rank, lane.xs[rank][i],
                          [column[i] for column in lane.columns[rank]])
                         for rank in order for i in range(lane.start[rank], len(lane.xs[rank])))
        now = self.clock()
        for _, rank, x, values in waiting:  # none is complete: no update comes of it
            self._add_point(rank, key, x, {"key": key, "x": x, "values": dict(zip(names, values))}, now)

    def _new_sender(self, key: str, name: str, rank: int, x: float, now: float) -> None:
        self._flush_lane(key)  # (its ranks change)
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
        reporters = self.history.reporters
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
        for key, _ in due:
            self._flush_lane(key)  # (its reporters change)
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
        lane = self._lanes.get(key)
        if not (pending or lane) or len(latest) < len(ranks) or not ranks <= latest.keys():
            return []
        floor = min(map(latest.__getitem__, ranks))
        if lane is not None and lane.done and lane.done[0][0][0] < floor:  # (made whole: closing them is all)
            kept = []
            for xs, index, taken in lane.done:
                if xs[-1] < floor:
                    continue
                if xs[0] < floor:
                    cut = bisect.bisect_left(xs, floor)
                    xs, index = xs[cut:], index + cut
                    taken = {rank: [column[cut:] for column in columns] for rank, columns in taken.items()}
                kept.append((xs, index, taken))
            lane.done = kept
        if not pending:
            return []
        if next(iter(pending)) >= floor:
            return []
        updates = []
        while pending:
            oldest = next(iter(pending))
            if oldest >= floor:
                break
            point = pending.pop(oldest)
            if point.index is not None and all(point.released.get(name) == len(by_rank)
                                               for name, by_rank in point.values.items()):
                continue  # (the common case: its record holds every value that arrived)
            updates += self._release(key, oldest, point, final=True)
        return updates

    def reached(self) -> dict[str, float]:
        """Per x key, where the ranks were: one past the highest x any rank reported (the one under way)."""
        reached = {}
        for key, latest in self._latest.items():
            where = self._where.get(key)
            highest = where.highest() if where is not None else None
            reached[key] = max(list(latest.values()) + ([] if highest is None else [highest])) + 1
        return reached

    def new_attempt(self) -> None:
        """The job restarts on fresh ranks.  Its records stay until the new attempt replays their x values; what
        the failed attempt left unfinished is dropped where the new attempt replays it, and released as partial
        where it does not (its first report lies beyond, or the job ends)."""
        for key in list(self._lanes):
            self._flush_lane(key)
        for key, pending in self._pending.items():
            self._orphans.setdefault(key, {}).update(pending)
            pending.clear()
        self._latest.clear()
        self._stale_below, self._fresh = len(self.history), set()

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
            self._unstale(key, old_x)  # not replayed: what the failed attempt reduced of it stays
            updates += self._release(key, old_x, orphans.pop(old_x), final=True)
        return updates

    def finish(self) -> list[dict]:
        """The job ended: release everything still held back, marked partial where reporters are missing."""
        for key in list(self._lanes):
            self._flush_lane(key)
        updates = self.settle(float("inf"))
        for key, orphans in self._orphans.items():
            for x in sorted(orphans):
                self._unstale(key, x)
                updates += self._release(key, x, orphans[x], final=True)
            orphans.clear()
        for key, pending in self._pending.items():
            for x in sorted(pending):
                updates += self._release(key, x, pending[x], final=True)
            pending.clear()
        return updates

    def _record_of(self, key: str, x) -> int | None:
        """The index of the record of that x, None if it has none yet."""
        where = self._where.get(key)
        return where.find(x) if where is not None else None

    def _is_stale(self, index: int) -> bool:
        return index < self._stale_below and index not in self._fresh

    def _unstale(self, key: str, x) -> None:
        index = self._record_of(key, x)
        if index is not None and self._is_stale(index):
            self._fresh.add(index)

    def _reduce(self, name: str, by_rank: dict[int, tuple[float, float]]) -> float:
        return _reduce(name in self.summed, [by_rank[r] for r in sorted(by_rank)])

    def _new_record(self, key: str, x, meta: dict, reduced: dict, own: dict, partial: list) -> tuple[int, dict]:
        """The record of an x that has none: its index, and its update."""
        history = self.history
        update = {key: x, **meta, **reduced} if meta else {key: x, **reduced}
        if partial:
            update["partial"] = ",".join(partial)
        total = self.totals.get(key)
        if total is None:
            index = history._append_record(update, own)
        else:
            record = {key: x, TOTAL_KEYS[key]: total}
            record.update(update)
            index = history._append_record(record, own)
        where = self._where.get(key)
        if where is None:
            where = self._where[key] = _XIndex(history, key)
        where.add(x, index)
        self.counts[key] = self.counts.get(key, 0) + 1
        return index, update

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
        history = self.history
        index = point.index if point.index is not None else self._record_of(key, x)
        if index is not None and reduced and self._is_stale(index):  # replayed by a restarted attempt: its
            self._fresh.add(index)                                     # values replace the old
            kept = (key, TOTAL_KEYS.get(key))
            history._remove(index, [name for name in history._fields(index) if name not in kept])
            history._clear_own(index)
        if index is None:
            if not (reduced or final or (not point.values and point.ranks >= self._key_ranks(key))):
                return []
            point.index, update = self._new_record(key, x, point.meta, reduced, own, partial)
            point.meta = {}
            return [update]
        if not reduced:
            point.index = index
            return []
        point.index = index
        update = {key: x, **point.meta, **reduced}
        earlier = history._get(index, "partial")
        earlier = earlier.split(",") if earlier else []
        # A value reduced again with a late rank's may be complete now: partial names only what still is.
        marked = [name for name in earlier if name not in reduced or name in partial]
        marked += [name for name in partial if name not in marked]
        if marked and (partial or marked != earlier):
            update["partial"] = ",".join(marked)
        elif not marked and earlier:
            history._remove(index, ("partial",))
        history._update(index, update)
        history._update_own(index, own)
        point.meta = {}
        return [update]
