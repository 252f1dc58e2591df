"""Where the ranks meet outside the process group: a meeting kept in the job's store.

A call that only some ranks make (``save_checkpoint`` under ``if rank == 0:``, a sharded value returned by one
rank alone) would hang in a collective; met in the store, it is refused after a timeout instead, naming the ranks
that did not come.  A warm pool's ranks meet here after an interrupt too, where the process group may be broken.
Checkpoints, sharded results and the pool's sync all meet through :func:`meet`.  Rank side.
"""
from __future__ import annotations

import datetime
from typing import Any, Sequence

from . import context


class Absent(Exception):
    """Not every rank came to a meeting within its timeout; this rank has left it as if it had never come."""

    def __init__(self, ranks: list[int], timeout: float):
        super().__init__(f"{ranks_text(ranks) if ranks else 'not every other rank'} did not come within "
                         f"{timeout:g} s")
        self.ranks = ranks  # those that had not come when this rank gave up (empty: they came and left again)
        self.timeout = timeout


def job_store() -> Any:
    """The job's store (a notebook's ranks), else the process group's own (under torchrun)."""
    ctx = context.current()
    store = ctx.store if ctx is not None else None
    if store is None:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
    return store


def waited(store: Any, keys: list[str], timeout_s: float) -> bool:
    """Wait at most ``timeout_s`` for ``keys`` in ``store``; False when they did not come.  A TCPStore says so with
    DistStoreError, a FileStore (a single-host job's) with a bare RuntimeError('Wait timeout')."""
    import torch.distributed as dist

    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        if isinstance(exc, dist.DistStoreError) or "timeout" in str(exc).lower():
            return False
        raise
    return True


def meet(key: str, rank: int, world_size: int, timeout: float, value: str = "", store: Any = None) -> list[str]:
    """Wait until every rank has come to the meeting ``key`` (at most ``timeout`` seconds); every rank's ``value``,
    by rank.  Raises :class:`Absent` where not every rank came in time: this rank then leaves the meeting as if it
    had never come, so that the ranks meet again under the same key.  The last rank to read the values removes
    the meeting's keys.  Nothing of the process group is used, so nothing hangs."""
    store = job_store() if store is None else store
    own, arrived, everyone, read = f"{key}/rank{rank}", f"{key}/arrived", f"{key}/all", f"{key}/read"
    store.set(own, value)
    if store.add(arrived, 1) == world_size:
        store.set(everyone, "")
    elif not waited(store, [everyone], timeout):
        absent = [other for other in range(world_size) if not store.check([f"{key}/rank{other}"])]
        # Only an arrival brings the count to world_size, and that arrival opens the meeting: once this rank has
        # left, no later one can (it gives up in its turn).
        left = store.add(arrived, -1)
        if left != world_size - 1:
            store.delete_key(own)
            if left == 0:
                store.delete_key(arrived)
            raise Absent(absent, timeout)
    values = [store.get(f"{key}/rank{other}").decode() for other in range(world_size)]
    if store.add(read, 1) == world_size:  # the last to read clears the meeting
        for name in (*(f"{key}/rank{other}" for other in range(world_size)), arrived, everyone, read):
            store.delete_key(name)
    return values


def ranks_text(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0, 2"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
