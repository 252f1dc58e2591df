"""The reduction of rank reports into history records (history.py), without processes."""
import csv

import pytest
from hypothesis import given, settings, strategies as st

from ddp_notebook.engine.history import SETTLE_S, History, Reducer
from ddp_notebook.wire.protocol import expand_reports, pack_reports

pytestmark = pytest.mark.timeout(10)


def metric(x, key="epoch", n=None, total=None, sums=(), **values):
    body = {"key": key, "x": x, "values": values}
    if n is not None:
        body["n"] = n
    if total is not None:
        body["total"] = total
    if sums:
        body["sum"] = list(sums)
    return body


def test_mean_over_two_ranks_is_exact():
    reducer = Reducer(2)
    for epoch in (1, 2, 3):
        for rank in (0, 1):
            reducer.add(rank, metric(epoch, total=3, loss=rank + 1))
    assert [r["loss"] for r in reducer.history] == [1.5, 1.5, 1.5]
    assert [r["epoch"] for r in reducer.history] == [1, 2, 3]
    assert reducer.history[0]["epochs"] == 3
    assert not any("partial" in r for r in reducer.history)
    assert reducer.history.by_rank == [{"loss": {0: 1.0, 1: 2.0}}] * 3  # each rank's own value, before the mean


def test_three_ranks_unequal_n_weighted_mean():
    reducer = Reducer(3)
    updates = []
    for rank, (value, n) in enumerate([(0.0, 10), (1.0, 20), (2.0, 30)]):
        updates += reducer.add(rank, metric(1, n=n, loss=value, acc=0.5))
    assert reducer.history[0]["loss"] == pytest.approx((0 * 10 + 1 * 20 + 2 * 30) / 60)
    assert reducer.history[0]["acc"] == 0.5
    assert len(updates) == 1  # released once, when the last rank arrived


def test_sum_instead_of_mean():
    reducer = Reducer(3)
    for rank in range(3):
        reducer.add(rank, metric(1, sums=["samples_per_s"], samples_per_s=100.0 * (rank + 1), loss=1.0))
    assert reducer.history[0]["samples_per_s"] == 600.0
    assert reducer.history[0]["loss"] == 1.0


def test_point_held_back_until_every_rank_reported_it():
    reducer = Reducer(2)
    for epoch in (1, 2, 3):
        assert reducer.add(0, metric(epoch, loss=1.0)) == []
    assert list(reducer.history) == []
    assert reducer.add(1, metric(1, loss=2.0)) == [{"epoch": 1, "loss": 1.5}]
    assert [r["epoch"] for r in reducer.history] == [1]


def test_slow_rank_releases_each_point_in_turn():
    reducer = Reducer(3)
    for epoch in range(1, 6):  # ranks 0 and 1 run ahead
        for rank in (0, 1):
            assert reducer.add(rank, metric(epoch, n=rank + 1, loss=float(epoch + rank))) == []
    for epoch in range(1, 6):  # the slow rank catches up, one epoch at a time
        updates = reducer.add(2, metric(epoch, n=3, loss=float(epoch + 2)))
        assert [u["epoch"] for u in updates] == [epoch]
        expected = (epoch * 1 + (epoch + 1) * 2 + (epoch + 2) * 3) / 6
        assert updates[0]["loss"] == pytest.approx(expected)
    assert len(reducer.history) == 5
    assert reducer.finish() == []


def test_key_only_some_ranks_report_is_reduced_over_them_at_the_end_and_labelled():
    reducer = Reducer(2)
    reducer.add(0, metric(1, loss=1.0, only_rank0=7.0))
    reducer.add(1, metric(1, loss=2.0))
    assert reducer.history[0] == {"epoch": 1, "loss": 1.5}
    updates = reducer.finish()
    assert updates == [{"epoch": 1, "only_rank0": 7.0}]  # rank 1 never reports it: not partial, rank 0's
    assert reducer.history[0] == {"epoch": 1, "loss": 1.5, "only_rank0": 7.0}
    assert reducer.history.reporters == {"only_rank0": [0]}


def test_a_metric_some_ranks_report_is_released_once_every_rank_moved_past_it():
    reducer = Reducer(2)
    reducer.add(0, metric(1, loss=1.0, only_rank0=7.0))
    reducer.add(1, metric(1, loss=2.0))
    reducer.add(0, metric(2, loss=1.0))
    assert "only_rank0" not in reducer.history[0]  # rank 1 may still be at epoch 1
    updates = reducer.add(1, metric(2, loss=2.0))
    assert {"epoch": 1, "only_rank0": 7.0} in updates


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_rank_0_alone_is_held_for_the_settling_wait_then_shown_step_by_step():
    clock = Clock()
    reducer = Reducer(2, clock=clock)
    assert reducer.add(0, metric(0, key="step", total=40, loss=1.0)) == []
    assert reducer.settles_in() == pytest.approx(SETTLE_S)
    clock.now = 0.5
    assert reducer.add(0, metric(1, key="step", total=40, loss=0.5)) == []  # rank 1 may still be starting
    clock.now = SETTLE_S
    assert reducer.settle() == [{"step": 0, "loss": 1.0}, {"step": 1, "loss": 0.5}]
    assert reducer.settles_in() is None
    for step in range(2, 40):  # from now on, each step as it arrives
        assert reducer.add(0, metric(step, key="step", total=40, loss=1.0 / (step + 1))) == \
            [{"step": step, "loss": 1.0 / (step + 1)}]
    assert reducer.finish() == []
    assert [r["step"] for r in reducer.history] == list(range(40))
    assert all(r["steps"] == 40 and "partial" not in r for r in reducer.history)
    assert reducer.history.reporters == {"loss": [0]}
    assert reducer.history.by_rank[5] == {"loss": {0: 1.0 / 6}}
    assert reducer.counts["step"] == 40 and reducer.notices == []


def test_every_rank_reporting_with_one_late_is_still_held_for_it():
    clock = Clock()
    reducer = Reducer(2, clock=clock)
    reducer.add(0, metric(0, key="step", loss=1.0))
    clock.now = SETTLE_S - 0.1
    assert reducer.add(1, metric(0, key="step", loss=3.0)) == [{"step": 0, "loss": 2.0}]
    clock.now = 10 * SETTLE_S
    assert reducer.add(0, metric(1, key="step", loss=1.0)) == []  # both report it: rank 1 is waited for
    assert reducer.add(1, metric(1, key="step", loss=3.0)) == [{"step": 1, "loss": 2.0}]
    assert reducer.history.reporters == {}


def test_a_rank_that_starts_reporting_later_joins_and_is_told_once():
    clock = Clock()
    reducer = Reducer(2, clock=clock)
    reducer.add(0, metric(0, key="step", loss=1.0))
    clock.now = SETTLE_S
    reducer.settle()
    assert reducer.add(0, metric(1, key="step", loss=1.0)) == [{"step": 1, "loss": 1.0}]
    # Rank 1 reports step 1 too, late: its value joins (step 1 is still open), and it is said once.
    assert reducer.add(1, metric(1, key="step", loss=3.0)) == [{"step": 1, "loss": 2.0}]
    assert len(reducer.notices) == 1 and "rank 1 started reporting loss at step 1" in reducer.notices[0]
    assert reducer.history.reporters == {}
    assert reducer.add(0, metric(2, key="step", loss=1.0)) == []  # now both are waited for
    assert reducer.add(1, metric(2, key="step", loss=3.0)) == [{"step": 2, "loss": 2.0}]
    assert reducer.add(1, metric(0, key="step", loss=3.0)) == []  # step 0 was closed without it: it stands
    assert reducer.history[0] == {"step": 0, "loss": 1.0}
    assert len(reducer.notices) == 1


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 4), steps=st.integers(1, 12), data=st.data())
def test_subsets_of_ranks_reporting_are_reduced_exactly_over_them(world, steps, data):
    names = data.draw(st.lists(st.sampled_from(["loss", "acc", "lr"]), min_size=1, max_size=3, unique=True))
    reporters = {name: data.draw(st.sets(st.integers(0, world - 1), min_size=1)) for name in names}
    values = {(rank, step, name): data.draw(st.floats(-1e3, 1e3)) for name in names for rank in reporters[name]
              for step in range(steps)}
    queues = {rank: [(step, {name: values[(rank, step, name)] for name in names if rank in reporters[name]})
                     for step in range(steps)] for rank in range(world)}
    queues = {rank: q for rank, q in queues.items() if any(v for _, v in q)}
    clock = Clock()
    reducer = Reducer(world, clock=clock)
    started = set()
    while queues:  # the ranks' reports interleaved at random, each rank's in order
        rank = data.draw(st.sampled_from(sorted(queues)))
        step, body = queues[rank].pop(0)
        if not queues[rank]:
            del queues[rank]
        if body:
            reducer.add(rank, metric(step, key="step", **body))
            started.add(rank)
        if started >= {r for ranks in reporters.values() for r in ranks}:
            clock.now += data.draw(st.sampled_from([0.0, SETTLE_S]))  # time passes once every reporter began
    reducer.finish()
    assert sorted(r["step"] for r in reducer.history) == list(range(steps))
    for record in reducer.history:
        assert "partial" not in record
        for name in names:
            expected = [values[(rank, record["step"], name)] for rank in sorted(reporters[name])]
            assert record[name] == pytest.approx(sum(expected) / len(expected))
    assert reducer.history.reporters == {name: sorted(ranks) for name, ranks in reporters.items()
                                         if len(ranks) < world}
    assert reducer.notices == []


def test_flush_of_ranks_that_never_got_there():
    reducer = Reducer(3)
    for rank in range(3):
        reducer.add(rank, metric(1, loss=1.0))
    reducer.add(0, metric(2, loss=4.0))
    reducer.add(1, metric(2, loss=2.0))  # rank 2 died before epoch 2
    assert len(reducer.history) == 1
    assert reducer.finish() == [{"epoch": 2, "loss": 3.0, "partial": "loss"}]
    assert reducer.history[1] == {"epoch": 2, "loss": 3.0, "partial": "loss"}


def test_several_reports_for_one_x_make_one_record():
    reducer = Reducer(2)
    for rank in (0, 1):
        reducer.add(rank, metric(1, train_loss=1.0 + rank))
    for rank in (0, 1):
        reducer.add(rank, metric(1, val_loss=3.0 + rank))
    assert list(reducer.history) == [{"epoch": 1, "train_loss": 1.5, "val_loss": 3.5}]


def test_steps_carry_their_epoch_and_keep_apart_from_epochs():
    reducer = Reducer(2)
    for rank in (0, 1):
        reducer.add(rank, {**metric(10, key="step", loss=1.0), "epoch": 0})
        reducer.add(rank, metric(0, acc=0.5))
    assert list(reducer.history) == [{"step": 10, "epoch": 0, "loss": 1.0}, {"epoch": 0, "acc": 0.5}]
    assert reducer.counts == {"step": 1, "epoch": 1}


def test_history_to_csv(tmp_path):
    history = History([{"epoch": 1, "loss": 1.5}, {"epoch": 2, "loss": 1.25, "acc": 0.5, "partial": "acc"}])
    path = tmp_path / "history.csv"
    history.to_csv(str(path))
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [{"epoch": "1", "loss": "1.5", "acc": "", "partial": ""},
                    {"epoch": "2", "loss": "1.25", "acc": "0.5", "partial": "acc"}]


def test_a_restarted_attempt_replaces_the_epochs_it_replays_and_keeps_one_record_per_epoch():
    from ddp_notebook.engine.history import Reducer

    reducer = Reducer(2)
    for epoch in (0, 1):
        for rank in (0, 1):
            reducer.add(rank, {"key": "epoch", "x": epoch, "values": {"loss": 10.0 + epoch}})
    reducer.add(0, {"key": "epoch", "x": 2, "values": {"loss": 12.0}})  # rank 1's report of epoch 2 was lost
    reducer.add(0, {"key": "epoch", "x": 3, "values": {"loss": 13.0}})
    assert reducer.reached() == {"epoch": 4}
    reducer.new_attempt()  # the new attempt resumes from the checkpoint of epoch 0: it replays epochs 1 and 2
    for rank in (0, 1):
        reducer.add(rank, {"key": "epoch", "x": 1, "values": {"loss": 1.0}})
    for rank in (0, 1):
        reducer.add(rank, {"key": "epoch", "x": 2, "values": {"loss": 2.0}})
    reducer.finish()
    assert [(r["epoch"], r["loss"], r.get("partial")) for r in reducer.history] == \
        [(0, 10.0, None), (1, 1.0, None), (2, 2.0, None), (3, 13.0, "loss")]


def test_what_a_failed_attempt_left_unfinished_and_the_new_one_skips_is_kept_as_partial():
    from ddp_notebook.engine.history import Reducer

    reducer = Reducer(2)
    for rank in (0, 1):
        reducer.add(rank, {"key": "epoch", "x": 0, "values": {"loss": 10.0}})
    reducer.add(0, {"key": "epoch", "x": 1, "values": {"loss": 11.0}})  # rank 1 died before reporting epoch 1
    reducer.new_attempt()
    for rank in (0, 1):  # resumed from epoch 1's checkpoint (saved before the fault): starts at epoch 2
        reducer.add(rank, {"key": "epoch", "x": 2, "values": {"loss": 2.0}})
    assert [(r["epoch"], r["loss"], r.get("partial")) for r in reducer.history] == \
        [(0, 10.0, None), (1, 11.0, "loss"), (2, 2.0, None)]


def _exact(value):
    """A value in a form where equal means the same number of the same type (nan equal to nan, -0.0 not 0.0)."""
    if isinstance(value, dict):
        return sorted((k, _exact(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_exact(v) for v in value]
    return (type(value).__name__, repr(value))


_X_POOL = [0, 1, 2, 3, 5, 8, 2.5, 7.25, 2 ** 60, 2 ** 60 + 1, 2 ** 64 + 3]  # 2**60 and 2**60+1: one float
_VALUES = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 70, 2 ** 70),
                    st.integers(-5, 5))


@pytest.mark.timeout(120)
@settings(max_examples=100, deadline=None)
@given(world=st.integers(1, 3), data=st.data())
def test_what_users_read_back_is_what_ranks_reported_element_for_element(world, data):
    """Generated report streams (two x keys, ranks reporting some metrics, ints huge and small, floats with nan,
    inf and -0.0, weights, sums, totals, epochs on steps), interleaved at random: the history holds one record per
    x reported, each rank's own values exactly as sent, the reduction of exactly those, partial markers exactly where
    a rank that reports a metric is missing, and the reporters; read back by index, slice, iteration, json and
    pickle alike."""
    import json
    import pickle

    names = ["loss", "acc", "samples"]
    summed = set(data.draw(st.sets(st.sampled_from(names), max_size=1)))
    keys = data.draw(st.sets(st.sampled_from(["step", "epoch"]), min_size=1))
    totals = {key: data.draw(st.one_of(st.none(), st.integers(1, 10 ** 6))) for key in keys}
    streams = {}  # rank -> its reports, in its order
    sent = {}  # (key, x) -> rank -> (values, n)
    for rank in range(world):
        reports = []
        for key in sorted(keys):
            mine = data.draw(st.sets(st.sampled_from(names), min_size=1))  # what this rank reports with key
            xs = sorted(data.draw(st.sets(st.sampled_from(_X_POOL), max_size=5)))
            for position, x in enumerate(xs):
                # its first report of a key names all it will report with it (so who reports what is known before
                # any x can be released without a rank); later ones may leave some out
                chosen = mine if position == 0 else data.draw(st.sets(st.sampled_from(sorted(mine)), min_size=1))
                values = {name: data.draw(_VALUES) for name in sorted(chosen)}
                n = data.draw(st.one_of(st.none(), st.integers(0, 3)))
                body = metric(x, key=key, n=n, total=totals[key], sums=sorted(summed & set(values)), **values)
                if key == "step" and data.draw(st.booleans()):
                    body["epoch"] = 7
                reports.append(body)
                sent.setdefault((key, x), {})[rank] = (values, n, "epoch" in body)
        # each key's reports in x order; the keys interleaved at random
        by_key = {key: [b for b in reports if b["key"] == key] for key in keys}
        ordered = []
        while any(by_key.values()):
            key = data.draw(st.sampled_from(sorted(k for k, v in by_key.items() if v)))
            ordered.append(by_key[key].pop(0))
        streams[rank] = ordered

    reducer = Reducer(world, clock=Clock())
    pending = {rank: list(reports) for rank, reports in streams.items() if reports}
    while pending:  # the ranks' reports interleaved at random, each rank's in its order
        rank = data.draw(st.sampled_from(sorted(pending)))
        reducer.add(rank, pending[rank].pop(0))
        if not pending[rank]:
            del pending[rank]
    reducer.finish()
    history = reducer.history

    senders = {}  # (key, name) -> the ranks that ever reported it
    for (key, _), by_rank in sent.items():
        for rank, (values, _, _) in by_rank.items():
            for name in values:
                senders.setdefault((key, name), set()).add(rank)
    expected, expected_own = {}, {}
    for (key, x), by_rank in sent.items():
        record = {key: x}
        if totals[key] is not None:
            record[{"step": "steps", "epoch": "epochs"}[key]] = totals[key]
        if any(carried for _, _, carried in by_rank.values()):
            record["epoch"] = 7
        own, partial = {}, []
        for name in names:
            ranks = sorted(rank for rank, (values, _, _) in by_rank.items() if name in values)
            if not ranks:
                continue
            own[name] = {rank: by_rank[rank][0][name] for rank in ranks}
            pairs = [(by_rank[rank][0][name], 1.0 if by_rank[rank][1] is None else float(by_rank[rank][1]))
                     for rank in ranks]
            if name in summed:
                record[name] = sum(value for value, _ in pairs)
            elif sum(weight for _, weight in pairs) == 0:
                record[name] = sum(value for value, _ in pairs) / len(pairs)
            else:
                record[name] = sum(value * weight for value, weight in pairs) / sum(weight for _, weight in pairs)
            if not set(ranks) >= senders[(key, name)]:
                partial.append(name)
        if partial:
            record["partial"] = sorted(partial)
        expected[(key, x)], expected_own[(key, x)] = record, own

    records = list(history)
    assert len(records) == len(history) == len(history.by_rank) == len(expected)
    got = {}
    for index, record in enumerate(records):
        ident = next((key, record[key]) for key in ("step", "epoch") if key in record and (
            key, record[key]) in expected and not (key == "epoch" and "step" in record))
        assert ident not in got  # one record per x
        record = dict(record)
        if "partial" in record:
            record["partial"] = sorted(record["partial"].split(","))
        got[ident] = (record, history.by_rank[index])
        assert _exact(history[index]) == _exact(records[index]) == _exact(history[index - len(history)])
    assert _exact({k: v[0] for k, v in got.items()}) == _exact(expected)
    assert _exact({k: v[1] for k, v in got.items()}) == _exact(expected_own)
    assert history.reporters == {name: sorted(ranks) for name in names
                                 if (ranks := set().union(*(senders.get((key, name), set()) for key in keys)))
                                 and len(ranks) < world}
    assert reducer.notices == []
    assert _exact(history[1:]) == _exact(records[1:]) and _exact(list(reversed(history))) == _exact(records[::-1])
    assert json.dumps(history) == json.dumps(records)
    again = pickle.loads(pickle.dumps(history))
    assert _exact(list(again)) == _exact(records) and _exact(list(again.by_rank)) == _exact(list(history.by_rank))
    assert again.reporters == history.reporters


def test_a_history_reads_as_a_list_and_is_filled_by_the_job_alone():
    history = History([{"epoch": 1, "loss": 1.5}, {"epoch": 2, "loss": 1.25, "partial": "loss"}])
    assert isinstance(history, list) and history == [{"epoch": 1, "loss": 1.5},
                                                     {"epoch": 2, "loss": 1.25, "partial": "loss"}]
    assert [{"epoch": 1, "loss": 1.5}] != history and history[-1]["epoch"] == 2 and history[:1] == [history[0]]
    assert repr(history) == "[{'epoch': 1, 'loss': 1.5}, {'epoch': 2, 'loss': 1.25, 'partial': 'loss'}]"
    assert {"epoch": 1, "loss": 1.5} in history and history.index({"epoch": 2, "loss": 1.25, "partial": "loss"}) == 1
    history[0]["loss"] = 9.0  # a record read is a copy
    assert history[0]["loss"] == 1.5
    with pytest.raises(TypeError, match="filled by the job alone"):
        history.append({"epoch": 3})
    with pytest.raises(IndexError):
        history[2]


def test_a_long_history_is_kept_in_columns():
    reducer = Reducer(2)
    steps = 20_000
    for step in range(steps):
        for rank in (0, 1):
            reducer.add(rank, metric(step, key="step", total=steps, loss=1.0 / (step + 1) + rank, acc=0.5))
    history = reducer.history
    assert len(history) == steps and history[12_345] == {"step": 12_345, "steps": steps, "acc": 0.5,
                                                          "loss": 1.0 / 12_346 + 0.5}
    assert history.by_rank[-1] == {"loss": {0: 1.0 / steps, 1: 1.0 / steps + 1}, "acc": {0: 0.5, 1: 0.5}}
    # step, steps, loss, acc and 2 x 2 ranks' own values: 9 bytes each, plus 8 bytes of shapes and 4 of index
    assert history.__sizeof__() < 100 * steps


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 3), steps=st.integers(1, 30), data=st.data())
def test_a_rank_s_batch_is_reduced_as_its_reports_one_by_one(world, steps, data):
    """add_many (a rank's metric event) makes the records, by-rank values and partial marks that add() one report
    at a time makes, however the ranks' batches are cut and interleaved, ranks skipping steps included."""
    names = data.draw(st.lists(st.sampled_from(["loss", "acc"]), min_size=1, max_size=2, unique=True))
    reports = {rank: [metric(step, key="step", total=steps, n=data.draw(st.sampled_from([None, 2, 5])),
                             **{name: data.draw(st.floats(-1e3, 1e3)) for name in names})
                      for step in range(steps) if data.draw(st.booleans()) or rank == 0]
               for rank in range(world)}
    batches = {rank: [] for rank in range(world)}  # each rank's reports cut into batches
    for rank, bodies in reports.items():
        while bodies:
            size = data.draw(st.integers(1, len(bodies)))
            batches[rank].append(bodies[:size])
            bodies = bodies[size:]
    order = []  # the batches interleaved at random, each rank's in order
    while any(batches.values()):
        rank = data.draw(st.sampled_from([r for r in batches if batches[r]]))
        order.append((rank, batches[rank].pop(0)))
    one_by_one, batched = Reducer(world, clock=Clock()), Reducer(world, clock=Clock())
    for rank, batch in order:
        for body in batch:
            one_by_one.add(rank, body)
        batched.add_many(rank, batch)
    one_by_one.finish()
    batched.finish()
    # (Records can be made in another order: one that a rank's batch completes comes before those the batch's
    # end closes as partial, where one report at a time closes them as it goes; each x's record is the same.)
    def by_step(reducer):
        return sorted(zip(reducer.history, reducer.history.by_rank), key=lambda pair: pair[0]["step"])
    assert by_step(batched) == by_step(one_by_one) and len(batched.history) > 0
    assert batched.notices == one_by_one.notices


class _GeneralPathOnly(Reducer):
    """The reducer without its lane: every report through the general points."""

    def _open_lane(self, key, x, names):
        return None


@pytest.mark.timeout(90)
@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 3), steps=st.integers(1, 25), data=st.data())
def test_the_lane_makes_what_the_general_path_makes(world, steps, data):
    """Reports every step, packed in runs as a rank sends them, reduce to the records, by-rank values, updates,
    reporters and notices of the general path, however the ranks skip, repeat or delay steps, drop a metric, add
    a weight or an epoch, stop reporting, or report alone for a while."""
    names = ["loss", "acc"][:data.draw(st.integers(1, 2))]
    late_rank = data.draw(st.sampled_from([None] + list(range(world))))  # starts reporting a while later
    reports = {}
    for rank in range(world):
        mine = []
        for step in range(steps):
            if rank == late_rank and step < steps // 2:
                continue
            kind = data.draw(st.sampled_from(["plain"] * 6 + ["skip", "twice", "subset", "n", "epoch"]))
            if kind == "skip":
                continue
            values = {name: data.draw(st.floats(allow_nan=False, width=32)) for name in names}
            if kind == "subset" and len(names) > 1:
                values.pop(data.draw(st.sampled_from(names)))
            body = metric(step, key="step", total=steps, n=3 if kind == "n" else None, **values)
            if kind == "epoch":
                body["epoch"] = step // 4
            mine += [body, dict(body)] if kind == "twice" else [body]
        reports[rank] = mine
    batches = {rank: [] for rank in range(world)}
    for rank, bodies in reports.items():
        while bodies:
            size = data.draw(st.integers(1, len(bodies)))
            batches[rank].append(bodies[:size])
            bodies = bodies[size:]
    lane, general = Reducer(world, clock=Clock()), _GeneralPathOnly(world, clock=Clock())
    lane_updates, general_updates = [], []
    while any(batches.values()):
        rank = data.draw(st.sampled_from([r for r in batches if batches[r]]))
        batch = batches[rank].pop(0)
        if data.draw(st.booleans()):
            lane.clock.now += SETTLE_S
            general.clock.now += SETTLE_S
        lane_updates += lane.add_many(rank, pack_reports(batch))
        general_updates += general.add_many(rank, batch)
    lane_updates += lane.finish()
    general_updates += general.finish()
    # (repr: the same bits, nan and -0.0 included; inf - inf makes a nan of finite floats)
    assert repr(list(lane.history)) == repr(list(general.history))
    assert repr(list(lane.history.by_rank)) == repr(list(general.history.by_rank))
    assert repr(lane_updates) == repr(general_updates)
    assert lane.history.reporters == general.history.reporters
    assert lane.notices == general.notices
    assert lane.totals == general.totals and lane.counts == general.counts


_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-2 ** 70, 2 ** 70))


@st.composite
def _report(draw):
    """A report as a rank's report() builds it: key, x, values, then total, n, sum, epoch where given."""
    key = draw(st.sampled_from(["step", "epoch"]))
    names = draw(st.lists(st.sampled_from(["loss", "acc", "lr"]), max_size=3, unique=True))
    body = {"key": key, "x": draw(st.one_of(st.integers(0, 50), st.floats(0, 50))),
            "values": {name: draw(_numbers) for name in names}}
    for field, values in (("total", st.integers(1, 100)), ("n", _numbers), ("sum", st.just(names[:1])),
                          ("epoch", st.integers(0, 5))):
        if draw(st.integers(0, 3)) == 0:
            body[field] = draw(values)
    return body


@st.composite
def _plain_step(draw):
    """report(step=s, steps=10, loss=...): the report that travels in runs."""
    return {"key": "step", "x": draw(st.integers(0, 9)), "values": {"loss": draw(_numbers)}, "total": 10}


@settings(max_examples=300, deadline=None)
@given(reports=st.lists(st.one_of(_report(), _plain_step()), max_size=40))
def test_reports_packed_in_runs_unpack_to_the_same_reports_element_for_element(reports):
    """What a rank sends (pack_reports) reads back (expand_reports) as the same reports: every field, number
    type and bit (nan, -0.0, huge ints), order; alike neighbours travel as one run."""
    packed = pack_reports(reports)
    assert repr(list(expand_reports(packed))) == repr(reports)
    runs = [item for item in packed if type(item) is tuple]
    assert all(len(run[4]) > 1 for run in runs)
    assert len(packed) <= len(reports)
