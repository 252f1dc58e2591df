"""distributed_loader and all_reduce_metrics: real gloo ranks over 1,001 samples, and outside a job."""
import math
from collections import Counter

import pytest
import torch

import ddp_notebook
from ddp_notebook.rank import data

pytestmark = pytest.mark.timeout(120)

SAMPLES = 1001


def _samples():
    """Integer features and weights: every logit is exact, so accuracy cannot depend on batching."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randint(-4, 5, (SAMPLES, 6), generator=generator).float()
    y = torch.randint(0, 3, (SAMPLES,), generator=generator)
    weight = torch.randint(-2, 3, (3, 6), generator=generator).float()
    return torch.utils.data.TensorDataset(x, y, torch.arange(SAMPLES)), weight


def _evaluate(loader, weight):
    """Indices seen, correct predictions and count, over one pass of the loader."""
    seen, correct = [], 0
    for x, y, idx in loader:
        correct += int(((x @ weight.T).argmax(1) == y).sum())
        seen += idx.tolist()
    return seen, correct


def _on_each_rank(dataset, weight):
    import torch.distributed as dist

    out = {"world_size": dist.get_world_size()}
    exact = ddp_notebook.distributed_loader(dataset, batch_size=64, shuffle=False, exact=True)
    seen, correct = _evaluate(exact, weight)
    out["exact_seen"] = seen
    out["exact_batches"] = len(exact)
    out["exact"] = ddp_notebook.all_reduce_metrics(sums={"correct": correct, "n": len(seen)},
                                                   means={"accuracy": correct / len(seen)}, weight=len(seen))
    padded = ddp_notebook.distributed_loader(dataset, batch_size=64, shuffle=False)
    seen, correct = _evaluate(padded, weight)
    out["padded_seen"] = seen
    out["padded"] = ddp_notebook.all_reduce_metrics(sums={"correct": correct, "n": len(seen)})

    # Training order: the sampler epoch advances by itself on each pass.
    train = ddp_notebook.distributed_loader(dataset, batch_size=50)
    out["epochs"] = [[i for _, _, idx in train for i in idx.tolist()] for _ in range(3)]
    out["next_epoch"] = train.next_epoch
    train.set_epoch(1)  # still allowed, and repeats that epoch's order
    out["epoch_1_again"] = [i for _, _, idx in train for i in idx.tolist()]
    shuffled_exact = ddp_notebook.distributed_loader(dataset, batch_size=50, exact=True)
    out["exact_epochs"] = [[i for _, _, idx in shuffled_exact for i in idx.tolist()] for _ in range(2)]

    # A rank with nothing to count (weight 0, nan mean) does not spoil the weighted mean.
    rank = dist.get_rank()
    out["empty_rank"] = ddp_notebook.all_reduce_metrics(
        means={"loss": float("nan") if rank == 1 else 2.5 + rank}, weight=0 if rank == 1 else 10)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2 ranks", "3 ranks"])
def ranks(request):
    dataset, weight = _samples()
    results = ddp_notebook.launch(_on_each_rank, (dataset, weight), cpus=request.param)
    return dataset, weight, results


def _single_process_accuracy(dataset, weight):
    x, y, _ = dataset.tensors
    return ((x @ weight.T).argmax(1) == y).double().mean().item()


def test_exact_evaluation_sees_every_sample_once_and_matches_one_process(ranks):
    dataset, weight, results = ranks
    world_size = results[0]["world_size"]
    every = [i for r in results for i in r["exact_seen"]]
    assert sorted(every) == list(range(SAMPLES))  # each index exactly once, no padding
    assert [len(r["exact_seen"]) for r in results] == [len(range(r, SAMPLES, world_size)) for r in range(world_size)]
    expected = _single_process_accuracy(dataset, weight)
    assert 0.2 < expected < 0.8  # neither 0 nor 1: duplication could not hide in it
    for r in results:  # every rank holds the same reduced numbers
        assert r["exact"]["n"] == SAMPLES
        assert r["exact"]["correct"] / r["exact"]["n"] == pytest.approx(expected, abs=1e-6)
        assert r["exact"]["accuracy"] == pytest.approx(expected, abs=1e-6)  # weighted mean of rank means


def test_without_exact_the_sampler_pads_by_repeating_samples(ranks):
    dataset, weight, results = ranks
    world_size = results[0]["world_size"]
    every = [i for r in results for i in r["padded_seen"]]
    padded_total = math.ceil(SAMPLES / world_size) * world_size
    assert len(every) == padded_total > SAMPLES
    repeated = {i: c for i, c in Counter(every).items() if c > 1}
    assert sum(c - 1 for c in repeated.values()) == padded_total - SAMPLES
    assert set(every) == set(range(SAMPLES))
    skewed = results[0]["padded"]["correct"] / results[0]["padded"]["n"]
    assert results[0]["padded"]["n"] == padded_total
    assert abs(skewed - _single_process_accuracy(dataset, weight)) > 1e-6  # why exact=True exists


def test_each_epoch_covers_the_dataset_in_a_new_order(ranks):
    _, _, results = ranks
    world_size = results[0]["world_size"]
    for epoch in range(3):
        together = [i for r in results for i in r["epochs"][epoch]]
        assert set(together) == set(range(SAMPLES))
        assert len(together) == math.ceil(SAMPLES / world_size) * world_size
    for r in results:
        assert r["epochs"][0] != r["epochs"][1] != r["epochs"][2]
        assert r["next_epoch"] == 3
        assert r["epoch_1_again"] == r["epochs"][1]
    for epoch in range(2):
        together = [i for r in results for i in r["exact_epochs"][epoch]]
        assert sorted(together) == list(range(SAMPLES))
    assert results[0]["exact_epochs"][0] != results[0]["exact_epochs"][1]


def test_weighted_mean_ignores_a_rank_with_no_weight(ranks):
    _, _, results = ranks
    world_size = results[0]["world_size"]
    others = [2.5 + r for r in range(world_size) if r != 1]
    for r in results:
        assert r["empty_rank"]["loss"] == pytest.approx(sum(others) / len(others))


def test_outside_a_job_the_loader_covers_everything_and_reports_progress(monkeypatch):
    dataset, _ = _samples()
    calls = []
    monkeypatch.setattr(data, "_progress_reporter", lambda: lambda done, total: calls.append((done, total)))
    loader = ddp_notebook.distributed_loader(dataset, batch_size=100)
    first = [i for _, _, idx in loader for i in idx.tolist()]
    assert sorted(first) == list(range(SAMPLES)) and first != list(range(SAMPLES))
    assert calls == [(done, 11) for done in range(12)]
    second = [i for _, _, idx in loader for i in idx.tolist()]
    assert sorted(second) == list(range(SAMPLES)) and second != first
    quiet = ddp_notebook.distributed_loader(dataset, batch_size=100, progress=False)
    calls.clear()
    list(quiet)
    assert calls == []
    with pytest.raises(TypeError, match="own sampler"):
        ddp_notebook.distributed_loader(dataset, batch_size=10, sampler=range(SAMPLES))


def test_all_reduce_metrics_outside_a_job_is_the_identity():
    out = ddp_notebook.all_reduce_metrics(sums={"correct": torch.tensor(7), "n": 9}, means={"loss": 0.1}, weight=9)
    assert out == {"correct": 7.0, "n": 9.0, "loss": 0.1}
    with pytest.raises(ValueError, match="both a sum and a mean"):
        ddp_notebook.all_reduce_metrics(sums={"x": 1}, means={"x": 2})


class _Sender:
    """Stands in for a rank's channel to the notebook: records what would be sent."""

    broken = False

    def __init__(self):
        self.sent = []

    def send(self, kind, body=None):
        self.sent.append((kind, body))


def test_in_a_rank_the_loader_sends_its_progress_to_the_notebook(monkeypatch):
    from ddp_notebook.rank import context
    from ddp_notebook.rank import metrics

    monkeypatch.setattr(metrics, "PROGRESS_INTERVAL_S", 0.0)  # no throttling: every call is sent
    monkeypatch.setattr(metrics, "_last_progress_sent", float("-inf"))
    sender = _Sender()
    context.set_current(context.RankContext(rank=1, local_rank=1, world_size=2, local_world_size=2, sender=sender))
    try:
        dataset, _ = _samples()
        loader = ddp_notebook.distributed_loader(dataset, batch_size=100)
        assert len(loader) == 6  # rank 1's share: 501 of 1,001 samples
        for batch_number, _ in enumerate(loader, start=1):  # sent as each batch is handed out, not at the end
            assert sender.sent[-1] == ("progress", {"done": batch_number - 1, "total": 6})
        # first, once per task: the loader checks for a graceful stop (docs/long-runs.md)
        assert sender.sent == [("stoppable", {"task": None})] + \
            [("progress", {"done": done, "total": 6}) for done in range(7)]
        sender.sent.clear()
        list(ddp_notebook.distributed_loader(dataset, batch_size=100, progress=False))
        assert sender.sent == []
    finally:
        context.set_current(None)
