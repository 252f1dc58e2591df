"""The DDP models of this rank: each training forward is a graceful-stop boundary, their all-reduce is timed, and
after a hard stop the replicas are compared and, where they differ, made one again.

Every rank passes a DDP model's training forward in step (its backward all-reduces the gradients), so the forward is
a batch boundary for any training loop, a plain ``DataLoader`` one included (``stopping.at_forward``).  DDP syncs
parameters only in its constructor: ranks stopped hard one optimizer step apart would train diverged replicas in
every later cell of a warm pool, so :func:`reconcile` checks them.

Models are found without a global module hook (``torch.compile`` warns about those): :func:`install` wraps
``DistributedDataParallel.__init__`` once per process, and each model gets a forward pre-hook of its own.
"""
from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any

from . import stopping, timing

_models: list = []  # weak references to this rank's DDP models, in the order they were made
_training_forwards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> training forwards run
_backward_since: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> a backward since its boundary
_installed = False


def install() -> None:
    """Watch every DDP model made from now on in this process (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _watch(self)

    DistributedDataParallel.__init__ = __init__
    _not_traced(_before_forward)
    _installed = True


def _not_traced(fn) -> None:
    """Run ``fn`` (and what it calls) as plain Python under ``torch.compile`` (as ``torch.compiler.disable`` does,
    without importing torch._dynamo: 1.5 s): traced, its counters became guards that recompiled it every step."""
    try:
        from torch._C._dynamo import eval_frame

        skip = eval_frame._FrameExecStrategy(eval_frame._FrameAction.SKIP, eval_frame._FrameAction.SKIP)
        eval_frame.set_code_exec_strategy(fn.__code__, skip)
    except (ImportError, AttributeError, TypeError):  # a torch without it: traced, and recompiled (still correct)
        pass


def _watch(model) -> None:
    import torch
    import torch.distributed as dist

    if dist.get_world_size(model.process_group) != dist.get_world_size():
        return  # a model of some ranks (hybrid or ensemble parallelism): neither a boundary of all nor one replica
    _models[:] = [ref for ref in _models if ref() is not None]
    _models.append(weakref.ref(model))
    _training_forwards[model] = 0
    _backward_since[model] = True
    model.register_forward_pre_hook(_before_forward)
    trained = [p for p in model.parameters() if p.requires_grad]
    if trained:
        reference = weakref.ref(model)
        torch.autograd.graph.register_multi_grad_hook(trained, lambda _grads: _backward_ran(reference), mode="any")


def _backward_ran(reference) -> None:
    model = reference()
    if model is not None:
        _backward_since[model] = True


def _before_forward(model, _inputs) -> None:
    import torch

    timing.time_allreduce(model)
    if not (model.training and torch.is_grad_enabled()):
        return  # an evaluation forward may run on one rank alone: not a boundary
    join = getattr(model, "_join_config", None)
    if join is not None and join.enable:
        return  # under Join ranks run different numbers of forwards: no collective of ours may pair them
    _training_forwards[model] = _training_forwards.get(model, 0) + 1
    # Only the first training forward after a backward: a forward on one rank alone (a shape check on rank 0, with no
    # backward) would otherwise take part in an agreement the other ranks never join.  Every rank runs each backward.
    if not _backward_since.get(model, True):
        return
    _backward_since[model] = False
    stopping.at_forward()
def models() -> list:
    """This rank's live DDP models, oldest first."""
    return [model for model in (ref() for ref in _models) if model is not None]


def _checksum(model) -> tuple[float, float]:
    """Of the parameters only: buffers such as BatchNorm's running statistics are each rank's own between forwards
    (DDP broadcasts them from rank 0 before each)."""
    import torch

    with torch.no_grad():
        parts = [torch.stack([torch.sum(p, dtype=torch.float64), torch.linalg.vector_norm(p, dtype=torch.float64)])
                 for p in model.parameters()]
        total = torch.stack(parts).sum(0).cpu() if parts else torch.zeros(2, dtype=torch.float64)
    return float(total[0]), float(total[1])


def _name_in(namespace: dict, value: Any) -> str | None:
    def held(item):
        return item is value or getattr(item, "_orig_mod", None) is value  # (torch.compile's wrapper)

    return next((name for name, item in namespace.items() if held(item) and not name.startswith("_")), None)


def _training_state_of(model, namespace: dict) -> dict[str, Any]:
    """What trains ``model``, by its name in the cell: its optimizers, the LR schedulers that drive them, and the
    cell's gradient scalers.  A ZeroRedundancyOptimizer is left out: its state is sharded over the ranks anyway."""
    import torch

    params = {id(p) for p in model.parameters()}
    zero = getattr(sys.modules.get("torch.distributed.optim"), "ZeroRedundancyOptimizer", ())
    found = {name: value for name, value in namespace.items()
             if isinstance(value, torch.optim.Optimizer) and not isinstance(value, zero) and not name.startswith("_")
             and any(id(p) in params for group in value.param_groups for p in group["params"])}
    optimizers = {id(opt) for opt in found.values()}
    found.update({name: value for name, value in namespace.items()
                  if isinstance(value, torch.optim.lr_scheduler.LRScheduler) and not name.startswith("_")
                  and id(getattr(value, "optimizer", None)) in optimizers})
    if found:
        found.update({name: value for name, value in namespace.items()
                      if isinstance(value, torch.amp.GradScaler) and value.is_enabled() and not name.startswith("_")})
    return found


def _on_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_on_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def reconcile(namespace: dict, group=None) -> list[dict]:
    """After a hard stop, with every rank here: compare each DDP model across the ranks and give every rank rank
    0's parameters, buffers, optimizer, LR-scheduler and gradient-scaler state where they differ.  One entry per
    model: its name, whether the ranks agreed, each rank's count of training forwards, and what was copied."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    gc.collect()  # a DDP model the cell let go of sits in reference cycles until a collection, on each rank its own
    held = models()
    for model in held:  # a hard stop may have come between a rank's backward and another's: start alike
        _backward_since[model] = True
    mine = [(_training_forwards.get(model, 0), _checksum(model)) for model in held]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine, group=group)
    if len({len(states) for states in everyone}) != 1:
        counts = ", ".join(f"rank {r}: {len(states)}" for r, states in enumerate(everyone))
        return [{"name": None, "agreed": False, "forwards": [], "copied": [],
                 "problem": f"the ranks hold different numbers of DDP models ({counts}): nothing was copied"}]
    report = []
    for index, model in enumerate(held):
        states = [states[index] for states in everyone]
        entry = {"name": _name_in(namespace, model), "agreed": all(state == states[0] for state in states),
                 "forwards": [state[0] for state in states], "copied": []}
        report.append(entry)
        if entry["agreed"]:
            continue
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0, group=model.process_group)
        # What trains it, by name: rank 0 says which, as the ranks' namespaces may differ.
        training = _training_state_of(model, namespace)
        sent: list = [None]
        if dist.get_rank() == 0:
            try:
                sent[0] = {"states": {name: _on_cpu(value.state_dict()) for name, value in training.items()}}
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, not wait in the broadcast
                sent[0] = {"error": f"{type(exc).__name__}: {exc}"}
        dist.broadcast_object_list(sent, src=0, group=group)
        if "error" in sent[0]:
            raise RuntimeError(f"rank 0 could not share the training state of its DDP model: {sent[0]['error']}")
        for name, state in sent[0]["states"].items():
            if dist.get_rank() != 0 and name in training:
                training[name].load_state_dict(state)
        entry["copied"] = sorted(sent[0]["states"])
    return report
