"""Sharded models made whole for the notebook: FSDP2 (``fully_shard``), FSDP1 (``FullyShardedDataParallel``),
tensor parallel modules (DTensor parameters from ``parallelize_module``), their optimizers and bare DTensors.

A rank holds only its shards, so what a task returns cannot simply be pickled: at the task's end every rank walks its
own return value the same way (:func:`sharded_in`).  A rank that finds nothing sharded does nothing more: no
collective, no store operation (the rank template imports FSDP and DTensors, so most tasks end this way).  The ranks
that find something meet in the job's store (:mod:`.rendezvous`), not in the process group, and agree that every rank found the same
things in the same order (a rank that found nothing never arrives: the others refuse after
``DDP_NOTEBOOK_SHARDED_ARRIVAL_S`` seconds, where a collective would hang); then each DTensor is gathered one at a
time (``full_tensor()``, an all-gather every rank joins).  Rank 0 keeps a plain CPU copy of each; the other ranks drop
theirs at once, so they peak at their shards plus one tensor.  Rank 0 builds copies of the modules and optimizers on
those tensors, of the user's own class, without FSDP's hooks; the ranks' own objects are never changed (an FSDP2
module unsharded by a forward without backward is resharded first, as its next backward would).  An FSDP1 module
holds each rank's flat shard of several parameters at once, so it is gathered whole by FSDP1's own full state dict
(rank 0 only) and its optimizer by ``FSDP.optim_state_dict``, each one collective for the module.

Rank side; self-contained (torch is imported only where a task already did).
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import types
import warnings
from typing import Any, Callable, Iterator

from . import rendezvous

# What FSDP2 adds to a module's __dict__ (its state is found under a key made of this prefix and a uuid).
_FSDP_ATTRIBUTE_PREFIXES = ("__composable_api_state_key", "_fsdp_use_orig_params", "_is_fsdp_managed_module")
# Flags kept per forward hook id, beside the hooks themselves.
_HOOK_FLAGS = {"_forward_pre_hooks_with_kwargs": "_forward_pre_hooks", "_forward_hooks_with_kwargs": "_forward_hooks",
               "_forward_hooks_always_called": "_forward_hooks"}
# How long a rank that returns a sharded value waits for every other rank to say that it returns the same.
ARRIVAL_TIMEOUT_ENV = "DDP_NOTEBOOK_SHARDED_ARRIVAL_S"
ARRIVAL_TIMEOUT_S = 60.0
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray, range, types.FunctionType, type,
          types.ModuleType, types.BuiltinFunctionType, types.MethodType)


class ShardedResultError(RuntimeError):
    """A sharded value cannot be returned as it is (one clear message, on every rank)."""


def in_use() -> bool:
    """Can this process hold a sharded value at all (DTensors or FSDP imported)?  Same answer on every rank that ran
    the same code, so every rank skips the gather alike."""
    return "torch.distributed.tensor" in sys.modules or "torch.distributed.fsdp" in sys.modules


def is_dtensor(value: Any) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(value, dtensor.DTensor)


def is_fsdp1(module: Any) -> bool:
    return type(module).__name__ == "FullyShardedDataParallel" and \
        type(module).__module__.startswith("torch.distributed.fsdp")


def is_sharded_module(module: Any) -> bool:
    """Does ``module`` (an ``nn.Module``) hold a sharded part: an FSDP module, or DTensor parameters or buffers?"""
    for sub in module.modules():
        if is_fsdp1(sub) or _is_fsdp2(sub):
            return True
        if any(is_dtensor(t) for t in (*sub._parameters.values(), *sub._buffers.values())):
            return True
    return False


def _is_fsdp2(module: Any) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _is_sharded_optimizer(opt: Any) -> bool:
    return any(is_dtensor(p) or _is_flat(p) for group in opt.param_groups for p in group["params"])


def _is_flat(tensor: Any) -> bool:
    """An FSDP1 flat parameter: each rank's shard of several parameters, flattened together."""
    flat = sys.modules.get("torch.distributed.fsdp._flat_param")  # (its instances are of type Parameter)
    return flat is not None and isinstance(tensor, flat.FlatParameter)


def sharded_in(value: Any, where: str = "the value") -> list[tuple[str, Any]]:
    """The sharded modules, optimizers and DTensors in ``value``, each once, in a fixed order: (where it sits,
    the object).  Looks through dicts, lists, tuples and objects' attributes, as the result's pickler does."""
    import torch

    found: list[tuple[str, Any]] = []
    optimizers: list[tuple[str, Any]] = []  # the others (an FSDP1 model's with use_orig_params steps plain views)
    seen: set[int] = set()

    def visit(obj: Any, where: str) -> None:
        if isinstance(obj, _ATOMS) or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if is_dtensor(obj):
                found.append((where, obj))
        elif isinstance(obj, torch.nn.Module):
            if is_sharded_module(obj):
                found.append((where, obj))
        elif isinstance(obj, torch.optim.Optimizer):
            (found if _is_sharded_optimizer(obj) else optimizers).append((where, obj))
        elif isinstance(obj, dict):
            for key, item in list(obj.items()):
                visit(item, f"{where}[{key!r}]" if where else str(key))
        elif isinstance(obj, (list, tuple)):
            for index, item in enumerate(obj):
                visit(item, f"{where}[{index}]")
        elif isinstance(obj, (set, frozenset)):
            if any(is_dtensor(item) for item in obj):  # no order that every rank shares
                raise ShardedResultError(f"{where} is a set holding DTensors: a set has no order every rank shares "
                                         f"to gather them in; return them in a list or dict")
        elif isinstance(getattr(obj, "__dict__", None), dict):
            for name, item in list(vars(obj).items()):
                visit(item, f"{where}.{name}")

    visit(value, where)
    for place, opt in optimizers:
        if _fsdp1_model_of(opt, found) is not None:
            # (FSDP.optim_state_dict of such a model gave exp_avg values on CPU ranks that differ between calls)
            raise ShardedResultError(
                f"{place} is the optimizer of an FSDP1 model with use_orig_params=True, which cannot be returned "
                f"whole; return the model without it, or build the model with use_orig_params=False (or FSDP2's "
                f"fully_shard) to return both")
    for place, obj in found:
        if isinstance(obj, torch.optim.Optimizer) and _fsdp1_model_of(obj, found) is None and \
                any(_is_flat(p) for group in obj.param_groups for p in group["params"]):
            raise ShardedResultError(
                f"{place} is the optimizer of an FSDP1 model (FullyShardedDataParallel) that is not returned with "
                f"it: its state is each rank's flat shard, made whole only through its model; return the model "
                f"too, or FSDP.optim_state_dict(model, optimizer)")
    return found


def _fsdp1_model_of(opt: Any, found: list[tuple[str, Any]]) -> Any:
    """The returned module holding FSDP1 modules whose parameters (flat, or views with use_orig_params) ``opt``
    steps, or None."""
    import torch

    stepped = {id(p) for group in opt.param_groups for p in group["params"]}
    for _, obj in found:
        if isinstance(obj, torch.nn.Module) and any(is_fsdp1(sub) for sub in obj.modules()) and stepped and \
                stepped <= {id(p) for p in obj.parameters()}:
            return obj
    return None


def _describe(obj: Any, rank: int, world_size: int) -> tuple:
    """What every rank must agree on before gathering ``obj``: its kind, and the shapes it gathers and how, in
    order (so that every rank takes the same way for each tensor)."""
    shapes = [(tuple(t.shape), str(t.dtype), "rows" if _rows_to_rank0(t, rank, world_size) else "whole")
              for t in _gathered_tensors(obj)]
    return type(obj).__qualname__, shapes


def _row_chunks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """Each rank's (first row, row count) of a tensor sharded on dim 0 over ``world_size`` ranks, as ``torch.chunk``
    splits it (FSDP2's and DTensor's ``Shard(0)``): the last ranks may hold fewer rows, or none."""
    chunk = -(-rows // world_size)
    return [(min(r * chunk, rows), max(0, min(chunk, rows - r * chunk))) for r in range(world_size)]


def _rows_to_rank0(tensor: Any, rank: int, world_size: int) -> bool:
    """Can ``tensor`` be gathered by each rank sending its rows straight to rank 0 (a CPU DTensor sharded on dim 0
    over every rank in order: FSDP2's parameters and their optimizer state), with no rank but rank 0 holding more
    than its shard?"""
    if not is_dtensor(tensor):
        return False
    mesh, placements = tensor.device_mesh, tensor.placements
    if mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(0) or tensor.ndim == 0:
        return False
    local = tensor.to_local()
    return (local.device.type == "cpu" and mesh.mesh.tolist() == list(range(world_size)) and
            tuple(local.shape) == (_row_chunks(tensor.shape[0], world_size)[rank][1], *tensor.shape[1:]))


def _gathered_tensors(obj: Any) -> list:
    import torch

    if isinstance(obj, torch.nn.Module):
        return [t for sub in obj.modules() for t in (*sub._parameters.values(), *sub._buffers.values())
                if is_dtensor(t) or _is_flat(t)]
    if isinstance(obj, torch.optim.Optimizer):
        return [t for group in obj.param_groups for p in group["params"]
                for t in (p, *obj.state.get(p, {}).values()) if is_dtensor(t) or _is_flat(t)]
    return [obj]


def whole_copies(value: Any, where: str, rank: int, world_size: int, every_rank_runs: bool = True,
                 allocate: Callable[[tuple, Any], Any] | None = None) -> list[tuple]:
    """At a task's end, on every rank: the sharded things in ``value`` (:func:`sharded_in`), each with its whole copy
    on rank 0 (None elsewhere), in the order found: [(object, whole copy)].  ``allocate(shape, dtype)`` gives the
    memory of a whole tensor (the result's shared file: ``Store.new_tensor``), or None for a plain one.

    A rank that finds nothing returns [] at once, with no collective and no store operation.  The ranks that find
    something first agree, in the job's store, that every rank found the same (:func:`_agree`), then gather
    together.  Raises :class:`ShardedResultError` where that cannot be done."""
    if not in_use():
        return []
    found = sharded_in(value, where)
    if not found:
        return []
    if not every_rank_runs:
        raise ShardedResultError(f"{found[0][0]} is sharded over every rank, and this task runs on some of them "
                                 f"only: return it from a cell that runs on every rank")
    if world_size > 1:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ShardedResultError(f"{found[0][0]} is sharded, and the process group is gone: a sharded value is "
                                     f"gathered after the task returns, so leave the process group up until then")
        _agree([(place, _describe(obj, rank, world_size)) for place, obj in found], rank, world_size)
    gathering = _Gathering(keep=rank == 0, found=found, allocate=allocate, rank=rank, world_size=world_size)
    return [(obj, gathering.whole(obj)) for _, obj in found]


def _arrival_timeout() -> float:
    return float(os.environ.get(ARRIVAL_TIMEOUT_ENV) or ARRIVAL_TIMEOUT_S)


def _meeting_key() -> str:
    """This task's and attempt's meeting, the same on every rank (a warm pool's task ids are unique)."""
    from . import context

    ctx = context.current()
    task = ctx.task_id if ctx is not None and ctx.task is not None else "run"
    return f"ddp_notebook/sharded/{task}/{context.attempt()}"


def _agree(mine: list, rank: int, world_size: int) -> None:
    """Meet every other rank in the store and check that each returns the sharded values ``mine`` describes; raise
    :class:`ShardedResultError` where one returns others, or none within the arrival timeout (a rank that returns
    none never comes: it does nothing at a task's end).  Nothing of the process group is used, so nothing hangs."""
    mine = json.loads(json.dumps(mine))  # as every rank reads it back (tuples become lists)
    timeout = _arrival_timeout()
    try:
        every = [json.loads(v) for v in rendezvous.meet(_meeting_key(), rank, world_size, timeout, json.dumps(mine))]
    except rendezvous.Absent as absent:
        late = rendezvous.ranks_text(absent.ranks) if absent.ranks else "not every other rank"
        raise ShardedResultError(
            f"the ranks return different sharded values, which cannot be gathered: rank {rank} returns "
            f"{mine[0][0]}, and {late} returned no sharded value within {timeout:g} s (a rank may lag "
            f"{ARRIVAL_TIMEOUT_ENV} seconds); return the same sharded values on every rank") from None
    for other, theirs in enumerate(every):
        if theirs != mine:
            raise ShardedResultError(_difference(mine, theirs, rank, other))


def _difference(mine: list, theirs: list, rank: int, other: int) -> str:
    """Why rank ``rank``'s sharded values cannot be gathered together with rank ``other``'s."""
    for (place, described), (their_place, their_described) in zip(mine, theirs):
        if (place, described) != (their_place, their_described):
            return (f"the ranks return different sharded values, which cannot be gathered: rank {rank} has "
                    f"{place} ({described[0]}, {len(described[1])} sharded tensors) where rank {other} has "
                    f"{their_place} ({their_described[0]}, {len(their_described[1])} sharded tensors)")
    longer, at = (mine, rank) if len(mine) > len(theirs) else (theirs, other)
    extra = longer[min(len(mine), len(theirs))][0]
    return (f"the ranks return different sharded values, which cannot be gathered: only rank {at} returns "
            f"{extra}; return the same sharded values on every rank")


class _Gathering:
    """Whole copies of sharded things, one DTensor at a time; ``keep``: this rank keeps them (rank 0)."""

    def __init__(self, keep: bool, found: list[tuple[str, Any]] = (), allocate: Callable | None = None,
                 rank: int = 0, world_size: int = 1):
        self.keep = keep
        self.allocate = allocate
        self.rank, self.world_size = rank, world_size
        self.found = list(found)  # (where an FSDP1 optimizer finds its model)
        self.done: dict[int, Any] = {}  # id(original) -> its whole copy: a tensor shared by a model and an optimizer
        self._originals: list = []  # (keeps every original alive while its id is a key)

    def whole(self, obj: Any) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, torch.nn.Module):
            return self.module(obj)
        return self.optimizer(obj)

    def _remember(self, original: Any, copy: Any) -> Any:
        self.done[id(original)] = copy
        self._originals.append(original)
        return copy

    def tensor(self, tensor: Any) -> Any:
        if tensor is None or id(tensor) in self.done:
            return self.done.get(id(tensor))
        if not is_dtensor(tensor):
            return self._remember(tensor, tensor)  # a plain tensor: the result's pickler copies it
        import torch

        with torch.no_grad():
            full = self._gathered(tensor)
        if not self.keep:
            return self._remember(tensor, None)
        if isinstance(tensor, torch.nn.Parameter):
            full = torch.nn.Parameter(full, requires_grad=tensor.requires_grad)
        else:
            full.requires_grad_(tensor.requires_grad and tensor.grad_fn is None)
        return self._remember(tensor, full)

    def _gathered(self, tensor: Any) -> Any:
        """The whole of DTensor ``tensor`` on rank 0, in memory from ``allocate`` where it gives some; None on the
        other ranks."""
        import torch

        if _rows_to_rank0(tensor, self.rank, self.world_size):
            return self._rows_gathered(tensor)
        full = tensor.full_tensor()  # (every rank holds the whole tensor for a moment)
        if not self.keep:
            return None
        shared = self.allocate(tuple(full.shape), full.dtype) if self.allocate is not None else None
        if shared is None:
            return full.to("cpu")  # (already a fresh tensor of its own on a CPU rank: no second copy)
        return shared.copy_(full)

    def _rows_gathered(self, tensor: Any) -> Any:
        """Each rank sends its rows to rank 0, which receives them in place: the other ranks hold nothing more than
        their shards, rank 0 the whole tensor."""
        import torch.distributed as dist

        local = tensor.to_local()
        group = tensor.device_mesh.get_group()
        chunks = _row_chunks(tensor.shape[0], self.world_size)
        if not self.keep:
            if local.numel():
                dist.send(_as_bytes(local.contiguous()), dst=0, group=group)
            return None
        whole = self._new(tuple(tensor.shape), tensor.dtype)
        for source, (first, count) in enumerate(chunks):
            rows = whole.narrow(0, first, count)
            if source == self.rank:
                rows.copy_(local)
            elif rows.numel():
                dist.recv(_as_bytes(rows), src=source, group=group)
        return whole

    def _new(self, shape: tuple, dtype: Any) -> Any:
        import torch

        made = self.allocate(shape, dtype) if self.allocate is not None else None
        return made if made is not None else torch.empty(shape, dtype=dtype)

    def module(self, module: Any) -> Any:
        if any(is_fsdp1(sub) for sub in module.modules()):
            return self._fsdp1_module(module)
        for sub in module.modules():
            if _is_fsdp2(sub):
                sub.reshard()  # left unsharded by a forward without backward: the sharded parameters are the ones
                #                its optimizer steps
        return self._copy(_unwrapped(module))

    def _copy(self, module: Any) -> Any:
        if id(module) in self.done:
            return self.done[id(module)]
        parameters = {name: self.tensor(p) for name, p in module._parameters.items()}
        buffers = {name: self.tensor(b) for name, b in module._buffers.items()}
        children = {name: None if child is None else self._copy(_unwrapped(child))
                    for name, child in module._modules.items()}
        if not self.keep:
            return self._remember(module, None)
        copy = object.__new__(_plain_class(type(module)))
        state = _plain_attributes(module)
        state.update(_parameters=parameters, _buffers=buffers, _modules=children)
        copy.__dict__.update(state)
        return self._remember(module, copy)

    def _fsdp1_module(self, module: Any) -> Any:
        """A module holding FSDP1 modules, whole: FSDP1's full state dict (on rank 0 alone) put into a copy of the
        module tree without the FSDP1 wrappers."""
        if id(module) in self.done:
            return self.done[id(module)]
        fsdp = _fsdp1_api()
        with _quiet_fsdp1(), fsdp.FullyShardedDataParallel.state_dict_type(
                module, fsdp.StateDictType.FULL_STATE_DICT,
                fsdp.FullStateDictConfig(offload_to_cpu=_off_cpu(module), rank0_only=True)):
            state = module.state_dict()
        if not self.keep:
            return self._remember(module, None)
        flats = [p for p in module.parameters() if _is_flat(p)]
        requires_grad = all(p.requires_grad for p in flats) if flats else True
        copy = self._plain_tree(module, "", state, requires_grad, {})
        return self._remember(module, copy)

    def _plain_tree(self, module: Any, prefix: str, state: dict, requires_grad: bool, made: dict) -> Any:
        """A copy of ``module`` of the user's class, its FSDP1 wrappers and flat parameters left out, its
        parameters and buffers from the full state dict ``state`` (keys as FSDP1 writes them: no wrapper names)."""
        import torch

        while is_fsdp1(module):
            module = module._fsdp_wrapped_module
        if id(module) in made:
            return made[id(module)]
        children = dict(module._modules)
        names = [key[len(prefix):] for key in state if key.startswith(prefix) and "." not in key[len(prefix):]]
        buffers = {name: _on_cpu(state[prefix + name]) for name in module._buffers if prefix + name in state}
        parameters = {name: torch.nn.Parameter(_on_cpu(state[prefix + name]), requires_grad=requires_grad)
                      for name in names if name not in buffers and name not in children}  # (in the user's order)
        copy = object.__new__(_plain_class(type(module)))
        made[id(module)] = copy
        kept = {name: item for name, item in _plain_attributes(module).items() if name not in parameters}
        kept.update(_parameters=parameters, _buffers=buffers, _modules={
            name: None if child is None else self._plain_tree(child, f"{prefix}{name}.", state, requires_grad, made)
            for name, child in children.items()})
        copy.__dict__.update(kept)
        return copy

    def _fsdp1_optimizer(self, opt: Any) -> Any:
        """An FSDP1 model's optimizer, whole (``FSDP.optim_state_dict``, on rank 0 alone), bound to the whole copy
        of its model."""
        model = _fsdp1_model_of(opt, self.found)
        whole_model = self.whole(model)
        fsdp = _fsdp1_api()
        with _quiet_fsdp1(), fsdp.FullyShardedDataParallel.state_dict_type(
                model, fsdp.StateDictType.FULL_STATE_DICT,
                fsdp.FullStateDictConfig(offload_to_cpu=_off_cpu(model), rank0_only=True),
                fsdp.FullOptimStateDictConfig(offload_to_cpu=_off_cpu(model), rank0_only=True)):
            saved = fsdp.FullyShardedDataParallel.optim_state_dict(model, opt)
        if not self.keep:
            return self._remember(opt, None)
        named = dict(whole_model.named_parameters(remove_duplicate=False))
        order = {name: index for index, name in enumerate(named)}
        groups = [dict(group, params=[named[name] for name in sorted(group["params"], key=order.__getitem__)])
                  for group in saved["param_groups"]]
        copy = object.__new__(type(opt))
        copy.__dict__.update(vars(opt))
        copy.param_groups = groups
        copy.state = collections.defaultdict(dict, {named[name]: {key: _on_cpu(item) for key, item in held.items()}
                                                    for name, held in saved["state"].items()})
        return self._remember(opt, copy)

    def optimizer(self, opt: Any) -> Any:
        if id(opt) in self.done:
            return self.done[id(opt)]
        if _fsdp1_model_of(opt, self.found) is not None:
            return self._fsdp1_optimizer(opt)
        groups = [dict(group, params=[self.tensor(p) for p in group["params"]]) for group in opt.param_groups]
        states = [(whole_param, {key: self.tensor(item) if _is_tensor(item) else item
                                 for key, item in opt.state[p].items()})
                  for group, whole_group in zip(opt.param_groups, groups)
                  for p, whole_param in zip(group["params"], whole_group["params"]) if p in opt.state]
        if not self.keep:
            return self._remember(opt, None)
        copy = object.__new__(type(opt))
        copy.__dict__.update(vars(opt))
        copy.param_groups = groups
        copy.state = collections.defaultdict(dict, states)
        return self._remember(opt, copy)


def _plain_attributes(module: Any) -> dict:
    """``module``'s attributes without what torch.distributed added: FSDP's state, its hooks and their flags."""
    state = {name: item for name, item in vars(module).items() if not name.startswith(_FSDP_ATTRIBUTE_PREFIXES)}
    for name, item in state.items():
        if isinstance(item, dict) and "hooks" in name and name not in _HOOK_FLAGS:
            state[name] = type(item)((key, hook) for key, hook in item.items()
                                     if not _hook_from_torch_distributed(hook))
    for name, hooks in _HOOK_FLAGS.items():
        if name in state:
            state[name] = type(state[name])((key, flag) for key, flag in state[name].items() if key in state[hooks])
    return state


def _fsdp1_api() -> Any:
    import torch.distributed.fsdp as fsdp

    return fsdp


def _off_cpu(module: Any) -> bool:
    """Does ``module`` hold tensors off the CPU (FSDP1's offload_to_cpu breaks on CPU ranks: it frees the shard)."""
    return any(p.device.type != "cpu" for p in module.parameters())


def _on_cpu(value: Any) -> Any:
    """A tensor of FSDP1's full state dicts as a plain CPU tensor (they come out of autograd's views)."""
    return value.detach().to("cpu") if _is_tensor(value) else value


@contextlib.contextmanager
def _quiet_fsdp1() -> Iterator[None]:
    """FSDP1's state dict APIs warn, at every call, that they are deprecated: not the user's to read at a task's
    end."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", module=r"torch\.distributed")
        yield


def _as_bytes(tensor: Any) -> Any:
    """A contiguous tensor's memory as bytes (what gloo sends of any dtype)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _is_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _unwrapped(module: Any) -> Any:
    """The module inside DDP and ``torch.compile`` wrappers."""
    from ..wire.payload import unwrap_model

    return unwrap_model(module)


def _plain_class(cls: type) -> type:
    """The user's class of a module FSDP2 gave a class of its own (``FSDPNet`` -> ``Net``)."""
    while _from_torch_distributed(cls):
        bases = [base for base in cls.__bases__ if not _from_torch_distributed(base)]
        if len(bases) != 1:
            break
        cls = bases[0]
    return cls


def _from_torch_distributed(cls: type) -> bool:
    return (cls.__module__ or "").startswith("torch.distributed")


def _hook_from_torch_distributed(hook: Any) -> bool:
    """Is ``hook`` (a function, bound method, partial, or torch's wrapped hook) torch.distributed's (FSDP's, or a
    tensor parallel style's)?"""
    for attribute in ("hook", "func", "__func__"):  # torch's _WrappedHook, functools.partial, a bound method
        inner: Callable | None = getattr(hook, attribute, None)
        if inner is not None and inner is not hook:
            return _hook_from_torch_distributed(inner)
    return (getattr(hook, "__module__", None) or "").startswith("torch.distributed")
