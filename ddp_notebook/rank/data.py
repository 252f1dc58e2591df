"""Data loading and metric reduction that do the right DDP thing by default.

``distributed_loader`` gives each rank its share of a dataset, advances the
sampler's epoch by itself, and can split evaluation data so every sample is
seen exactly once.  ``all_reduce_metrics`` combines named numbers from every
rank in one collective.  Both work unchanged outside a job.
"""
from __future__ import annotations

import math
import mmap
import time
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate
from torch.utils.data.distributed import DistributedSampler

from . import context, metrics, profiling, stopping, timing


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the job's world size; (0, 1) outside a job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    ctx = context.current()
    if ctx is not None:
        return ctx.rank, ctx.world_size
    return 0, 1


_INDEX_CHUNK = 1 << 16  # indices turned into Python ints at a time
_OWN_MAPPING_MIN_BYTES = 1 << 20  # a gathered batch this big gets memory of its own, given back when it is freed


class ShardSampler(DistributedSampler):
    """``torch.utils.data.DistributedSampler`` without a Python list of every index.

    The same indices in the same order as torch's sampler for the same seed,
    epoch, padding and ``drop_last``, but each epoch's order is a tensor (int32
    where it fits) and the rank's share is handed out a chunk at a time: about
    12 bytes per sample of the dataset while iterated, not ~36 per index; a big order or share has memory of its
    own (see :func:`_gather`).
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)

    def order(self) -> torch.Tensor:
        """Every index of the dataset in this epoch's order (torch's seeded ``randperm``, or 0..n-1)."""
        n = len(self.dataset)
        dtype = torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64
        order = _empty(n, dtype)
        if not self.shuffle:
            return torch.arange(n, dtype=dtype, out=order)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=generator, dtype=dtype, out=order)  # the same order for any dtype

    def shard(self) -> torch.Tensor:
        """This rank's indices of this epoch, padded or cut as torch's sampler does."""
        order = self.order()
        n = len(order)
        if n == 0:
            return order
        within = order[self.rank:min(self.total_size, n):self.num_replicas]
        # Padding repeats the order from its start: position p of the padded order is order[p % n].
        padding = [p % n for p in range(self.rank + len(within) * self.num_replicas, self.total_size,
                                        self.num_replicas)]
        shard = _empty(self.num_samples, order.dtype)
        shard[:len(within)] = within
        if padding:
            shard[len(within):] = order[torch.tensor(padding)]
        return shard

    def __iter__(self) -> Iterator[int]:
        return _in_chunks(self.shard())

    def __len__(self) -> int:
        return self.num_samples


def _in_chunks(indices: torch.Tensor) -> Iterator[int]:
    for start in range(0, len(indices), _INDEX_CHUNK):
        yield from indices[start:start + _INDEX_CHUNK].tolist()


class ExactDistributedSampler(ShardSampler):
    """Every index exactly once across the ranks, with no padding.

    Rank ``r`` takes positions ``r, r + world_size, ...`` of the (shuffled)
    order, so ranks differ by at most one sample.  Because the ranks may then
    run different numbers of batches, evaluate on ``ddp_model.module`` (or
    inside ``ddp_model.join()``): DDP's own forward is a collective and would
    wait forever for the rank that has run out.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.total_size = len(dataset)
        self.num_samples = len(range(rank, self.total_size, num_replicas))


def _progress_reporter():
    """What a loader reports its progress to: :func:`ddp_notebook.progress` (a seam for tests)."""
    return metrics.progress


class DistributedLoader(DataLoader):
    """A DataLoader whose sampler moves to the next epoch each time it is iterated.

    The first iteration uses epoch 0 (or the epoch given to ``set_epoch``), the
    next one epoch 1, and so on, so the shuffle changes every epoch without a
    ``set_epoch`` call to forget.  Calling ``set_epoch(e)`` before iterating
    still works, as in plain PyTorch.
    """

    def __init__(self, *args, report_progress: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self._next_epoch = 0
        self.report_progress = report_progress

    @property
    def next_epoch(self) -> int:
        """The sampler epoch the next iteration will use (what a checkpoint stores)."""
        return self._next_epoch

    @property
    def epoch(self) -> int:
        """The sampler epoch of the current (or last) iteration."""
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use this sampler epoch."""
        self._next_epoch = int(epoch)
        self.sampler.set_epoch(self._next_epoch)
        self._in_this_task()["epoch_set"] = True

    def _in_this_task(self) -> dict:
        """This loader's passes in the running task (a warm pool's loader lives on across cells): the cell's own
        epoch count, and whether the cell set the sampler's epoch itself (then that epoch is the cell's)."""
        ctx = context.current()
        task = ctx.task_id if ctx is not None else None
        seen = self.__dict__.get("_task_passes")
        if seen is None or seen["task"] != task:
            seen = self.__dict__["_task_passes"] = {"task": task, "passes": 0, "epoch_set": False}
        return seen

    def _cell_epoch(self) -> int:
        seen = self._in_this_task()
        return self.epoch if seen["epoch_set"] else seen["passes"] - 1

    def __iter__(self):
        stopping.check_not_stopped()  # iterated again after a graceful stop: the cell ends here
        self.sampler.set_epoch(self._next_epoch)
        self._next_epoch += 1
        self._in_this_task()["passes"] += 1
        batches = super().__iter__()
        progress = _progress_reporter() if self.report_progress else None
        ctx = context.current()
        watched = ctx is not None and ctx.sender is not None
        stoppable = watched and not isinstance(self.sampler, ExactDistributedSampler)
        if progress is None and not watched:
            return batches
        return self._watching(batches, progress, stoppable)

    def _watching(self, batches, progress, stoppable: bool):
        """Report progress, time each step (rank/timing.py), and end the epoch early at the batch every rank
        agreed to stop at."""
        total = len(self)
        done = 0
        if stoppable:
            stopping.announce()
        profiling.step_by_loader()  # (its own progress() calls are not steps then)
        if progress is not None:
            progress(done, total)
        timing.watch_ddp()
        samples = self.batch_size or 1
        step_started = time.perf_counter()
        while True:
            wait_started = time.perf_counter()
            try:
                with profiling.data_wait():
                    batch = next(batches)
            except StopIteration:
                return
            data_s = time.perf_counter() - wait_started
            profiling.step(from_loader=True)
            if stoppable and stopping.at_batch(lambda: self._where(done)):
                return
            yield batch
            now = time.perf_counter()
            if done:  # the first step also pays for starting the epoch's workers: not a step
                timing.batch_done(data_s, now - step_started, samples)
            step_started = now
            done += 1
            if progress is not None:
                progress(done, total)


    def _where(self, batch: int) -> dict:
        where = {"epoch": self._cell_epoch(), "batch": batch}
        if where["epoch"] != self.epoch:
            where["sampler_epoch"] = self.epoch
        return where


class _Gathered(tuple):
    """A whole batch of a TensorDataset, one tensor per field, taken with one indexing per tensor."""


class _GatheringTensorDataset(TensorDataset):
    """The user's TensorDataset (the same tensors, no copy) that hands the loader whole batches.

    A DataLoader otherwise takes a batch one sample at a time (``dataset[i]`` for each index, a tensor view per
    field per sample) and stacks them: for 65,536 small samples that is 131,072 Python objects per batch, seconds
    per epoch and a heap that keeps the memory afterwards.  ``t[indices]`` gives the same values, dtype, shape and
    order as ``torch.stack([t[i] for i in indices])``.
    """

    def __getitems__(self, indices: list[int]) -> _Gathered:
        index = torch.as_tensor(indices, dtype=torch.int64)
        return _Gathered(_gather(t, index) for t in self.tensors)


def _own_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` of zeroed memory in an anonymous mapping of its own, unmapped when the tensor is freed."""
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), dtype=torch.uint8)


def _is_big(nbytes: int) -> bool:
    return nbytes > 0 and nbytes >= _OWN_MAPPING_MIN_BYTES


def _empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-d tensor; a big one in memory of its own (see :func:`_gather`)."""
    nbytes = n * dtype.itemsize
    return _own_memory(nbytes).view(dtype) if _is_big(nbytes) else torch.empty(n, dtype=dtype)


def _gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[index]``, contiguous as ``torch.stack`` makes it (a transposed or channels_last tensor's rows keep its
    layout otherwise).

    A big batch on the CPU goes into an anonymous mapping of its own, unmapped when the batch is freed.  From
    glibc's heap (where its allocator puts blocks of this size once it has freed one) the memory stays with the
    process after the batch is gone, and with a batch of 16 MB every step that was about 50 MB more per rank.
    """
    index = index.to(t.device)
    shape = (len(index), *t.shape[1:])
    nbytes = math.prod(shape) * t.element_size()
    if not _is_big(nbytes) or type(t) is not torch.Tensor or t.device.type != "cpu" or t.layout != torch.strided \
            or t.is_quantized or t.requires_grad or t.is_conj() or t.is_neg():  # these keep the plain path
        return t[index].contiguous()
    try:
        return torch.index_select(t, 0, index, out=_own_memory(nbytes).view(t.dtype).view(shape))
    except RuntimeError:  # index_select takes fewer dtypes than indexing (1-d uint16-64 in torch 2.13)
        return t[index].contiguous()


def _collate(batch):
    """``default_collate``, which gives a list for a TensorDataset's tuples, for batches gathered whole too."""
    if isinstance(batch, _Gathered):
        return list(batch)
    return default_collate(batch)


def _gathers_whole_batches(dataset: Dataset, batch_size: int | None, loader_kwargs: dict) -> bool:
    # A subclass may index, count or carry more than its tensors (its __getitem__, __getitems__, attributes)
    return type(dataset) is TensorDataset and batch_size is not None and loader_kwargs.get("collate_fn") is None


def distributed_loader(dataset: Dataset, batch_size: int = 1, shuffle: bool = True, exact: bool = False, *,
                       seed: int = 0, progress: bool = True, **loader_kwargs: Any) -> DistributedLoader:
    """A DataLoader over this rank's share of ``dataset``.

    Inside a job each rank gets a ``DistributedSampler`` share (``batch_size``
    is per rank; the indices and their order are torch's, kept in a tensor
    rather than a Python list, :class:`ShardSampler`); outside a job the loader
    covers the whole dataset.  The
    order is a seeded shuffle (``seed`` + epoch), the same for every rank, that
    changes each time the loader is iterated.

    ``exact=True`` is for evaluation: every sample is seen exactly once across
    the ranks even when the length does not divide by the world size (the
    default sampler repeats samples to pad, which skews metrics).  Ranks may
    then run one batch more or fewer, so evaluate on ``ddp_model.module`` or
    under ``ddp_model.join()``.  While iterated, the loader reports its
    in-epoch progress to the dashboard (``progress=False`` turns that off).
    A ``TensorDataset`` (the class itself, not a subclass) is indexed a whole batch at a time (one ``t[indices]``
    per tensor, not one sample at a time): the same batches, many times
    faster for small samples.  Other keyword arguments go to ``DataLoader``.
    """
    for taken in ("sampler", "batch_sampler"):
        if loader_kwargs.get(taken) is not None:
            raise TypeError(f"distributed_loader makes its own sampler; do not pass {taken}=")
    rank, world_size = rank_and_world_size()
    if exact:
        sampler: DistributedSampler = ExactDistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed)
    else:
        sampler = ShardSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed)
    if _gathers_whole_batches(dataset, batch_size, loader_kwargs):
        dataset = _GatheringTensorDataset(*dataset.tensors)
        loader_kwargs["collate_fn"] = _collate
    return DistributedLoader(dataset, batch_size=batch_size, sampler=sampler, report_progress=progress,
                             **loader_kwargs)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name!r} must be a single number, not a tensor of shape {tuple(value.shape)}")
        return float(value.detach().item())
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name!r} must be a number, not {type(value).__name__}") from None


def _reduce_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_metrics(sums: Mapping[str, Any] | None = None, means: Mapping[str, Any] | None = None,
                       weight: float = 1.0) -> dict[str, float]:
    """Combine named numbers across ranks in one collective; every rank gets the result.

    ``sums`` are added over the ranks.  ``means`` are averaged, each rank
    counting with ``weight`` (e.g. its number of samples), so per-rank means of
    unequal shares combine into the true overall mean.  Returns one dict of
    Python floats.  Outside a job, the values come back unchanged.  Every rank
    must call it, with the same names.
    """
    sums = dict(sums or {})
    means = dict(means or {})
    clash = sorted(set(sums) & set(means))
    if clash:
        raise ValueError(f"a name is both a sum and a mean: {', '.join(clash)}")
    sum_values = [_as_float(k, v) for k, v in sums.items()]
    mean_values = [_as_float(k, v) for k, v in means.items()]
    weight = _as_float("weight", weight)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        ctx = context.current()
        if ctx is not None and ctx.world_size > 1:
            raise RuntimeError("all_reduce_metrics needs the process group: call it after init_process_group")
        return {**dict(zip(sums, sum_values)), **dict(zip(means, mean_values))}
    # A rank with nothing to count (weight 0) adds nothing, even if its means are nan.
    weighted = [v * weight if weight else 0.0 for v in mean_values]
    packed = torch.tensor(sum_values + weighted + [weight], dtype=torch.float64, device=_reduce_device())
    dist.all_reduce(packed)
    reduced = packed.tolist()
    total_weight = reduced[-1]
    result = dict(zip(sums, reduced[:len(sums)]))
    for name, weighted in zip(means, reduced[len(sums):-1]):
        result[name] = weighted / total_weight if total_weight else math.nan
    return result
