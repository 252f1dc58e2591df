"""rank/rendezvous.py: the one meeting in the job's store that checkpoints, sharded results and the pool's sync use,
with ranks as threads, each with its own client of a real TCPStore."""
from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from ddp_notebook.rank import rendezvous


@pytest.fixture
def stores():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30))
               for _ in range(3)]
    yield master, clients


def _meet_all(clients, key, ranks, timeout, values=None):
    """Each rank in ``ranks`` meets on its own thread; rank -> its answer (the values, or the Absent raised)."""
    found = {}

    def one(rank):
        try:
            found[rank] = rendezvous.meet(key, rank, len(clients), timeout, (values or {}).get(rank, f"v{rank}"),
                                          store=clients[rank])
        except rendezvous.Absent as exc:
            found[rank] = exc

    threads = [threading.Thread(target=one, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return found


def test_every_rank_gets_every_value_and_the_meeting_leaves_no_key(stores):
    master, clients = stores
    found = _meet_all(clients, "k/1", [0, 1, 2], timeout=20)
    assert found == {rank: ["v0", "v1", "v2"] for rank in range(3)}
    names = [f"k/1/rank{r}" for r in range(3)] + ["k/1/arrived", "k/1/all", "k/1/read"]
    assert not any(master.check([name]) for name in names)


def test_a_rank_that_never_comes_is_named_and_the_ranks_can_meet_again_under_the_same_key(stores):
    master, clients = stores
    found = _meet_all(clients, "k/2", [0, 2], timeout=1)
    assert set(found) == {0, 2}
    for rank in (0, 2):  # (the one that gives up last may also miss the other, which has left by then)
        assert isinstance(found[rank], rendezvous.Absent), found
        assert 1 in found[rank].ranks and rank not in found[rank].ranks, found
        assert str(found[rank]).endswith("did not come within 1 s")
    # Each left as if it had never come: all three meet again under the same key, with new values.
    again = _meet_all(clients, "k/2", [0, 1, 2], timeout=20, values={0: "a", 1: "b", 2: "c"})
    assert again == {rank: ["a", "b", "c"] for rank in range(3)}
    assert not master.check(["k/2/arrived"])


def test_a_rank_whose_wait_ran_out_as_the_last_arrived_stays_in_the_meeting():
    """The last arrival opens the meeting: a rank whose wait ran out just before, and that has not left yet, finds
    the meeting open as it leaves and stays, so every rank gets every value once."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    clients = [dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=30)) for _ in (0, 1)]
    found = {}
    late = threading.Thread(target=lambda: found.setdefault(1, rendezvous.meet("k/3", 1, 2, 20, "v1",
                                                                               store=clients[1])))

    class Racing:
        """Rank 0's client: rank 1 arrives right after rank 0's wait ran out, before rank 0 leaves."""

        def __getattr__(self, name):
            return getattr(clients[0], name)

        def add(self, key, amount):
            if key == "k/3/arrived" and amount == -1:
                late.start()
                master.wait(["k/3/all"])
            return clients[0].add(key, amount)

    assert rendezvous.meet("k/3", 0, 2, 0.5, "v0", store=Racing()) == ["v0", "v1"]
    late.join(30)
    assert found[1] == ["v0", "v1"]
    assert not master.check(["k/3/arrived"]) and not master.check(["k/3/rank0"])


def test_ranks_text():
    assert rendezvous.ranks_text([3]) == "rank 3"
    assert rendezvous.ranks_text([0, 2]) == "ranks 0, 2"
