"""The reduction of rank reports into history records (history.py), without processes."""
import csv

import pytest

from ddp_notebook.engine.history import History, Reducer

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


def test_key_only_some_ranks_report_is_flushed_at_the_end_and_marked():
    reducer = Reducer(2)
    reducer.add(0, metric(1, loss=1.0, only_rank0=7.0))
    reducer.add(1, metric(1, loss=2.0))
    assert reducer.history[0] == {"epoch": 1, "loss": 1.5}
    updates = reducer.finish()
    assert updates == [{"epoch": 1, "only_rank0": 7.0, "partial": "only_rank0"}]
    assert reducer.history[0] == {"epoch": 1, "loss": 1.5, "only_rank0": 7.0, "partial": "only_rank0"}


def test_partial_point_released_once_every_rank_moved_past_it():
    reducer = Reducer(2)
    reducer.add(0, metric(1, loss=1.0, only_rank0=7.0))
    reducer.add(1, metric(1, loss=2.0))
    reducer.add(0, metric(2, loss=1.0))
    assert "only_rank0" not in reducer.history[0]  # rank 1 may still be at epoch 1
    updates = reducer.add(1, metric(2, loss=2.0))
    assert {"epoch": 1, "only_rank0": 7.0, "partial": "only_rank0"} in updates
    assert reducer.history[0]["partial"] == "only_rank0"


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
