"""The reduction of rank reports into history records (history.py), without processes."""
import csv

import pytest
from hypothesis import given, settings, strategies as st

from ddp_notebook.engine.history import SETTLE_S, History, Reducer

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
