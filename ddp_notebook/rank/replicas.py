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
import weakref
from typing import Any

from . import stopping, timing

_models: list = []  # weak references to this rank's DDP models, in the order they were made
_training_forwards: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> training forwards run
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
    _installed = True


def _watch(model) -> None:
    _models.append(weakref.ref(model))
    _training_forwards[model] = 0
    model.register_forward_pre_hook(_before_forward)


def _before_forward(model, _inputs) -> None:
    import torch

    timing.time_allreduce(model)
    if not (model.training and torch.is_grad_enabled()):
        return  # an evaluation forward may run on one rank alone: not a boundary
    join = getattr(model, "_join_config", None)
    if join is not None and join.enable:
        return  # under Join ranks run different numbers of forwards: no collective of ours may pair them
    _training_forwards[model] = _training_forwards.get(model, 0) + 1
    stopping.at_forward()


def models() -> list:
    """This rank's live DDP models, oldest first."""
    return [model for model in (ref() for ref in _models) if model is not None]


def _checksum(model) -> tuple[float, float]:
    import torch

    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            values = tensor.detach().to(torch.float64)
            total += torch.stack([values.sum(), values.square().sum()]).cpu()
    return float(total[0]), float(total[1])


def _name_in(namespace: dict, value: Any) -> str | None:
    return next((name for name, held in namespace.items() if held is value and not name.startswith("_")), None)


def _training_state_of(model, namespace: dict) -> dict[str, Any]:
    """The optimizers that train ``model`` and the LR schedulers that drive them, by their names in the cell."""
    import torch

    params = {id(p) for p in model.parameters()}
    found = {name: value for name, value in namespace.items()
             if isinstance(value, torch.optim.Optimizer) and not name.startswith("_")
             and any(id(p) in params for group in value.param_groups for p in group["params"])}
    optimizers = {id(opt) for opt in found.values()}
    found.update({name: value for name, value in namespace.items()
                  if isinstance(value, torch.optim.lr_scheduler.LRScheduler) and not name.startswith("_")
                  and id(getattr(value, "optimizer", None)) in optimizers})
    return found


def _on_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    return value


def reconcile(namespace: dict, group=None) -> list[dict]:
    """After a hard stop, with every rank here: compare each DDP model across the ranks and give every rank rank
    0's parameters, buffers, optimizer and LR-scheduler state where they differ.  One entry per model: its name,
    whether the ranks agreed, each rank's count of training forwards, and what was copied from rank 0."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    held = models()
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
        name = _name_in(namespace, model)
        entry = {"name": name, "agreed": all(state == states[0] for state in states),
                 "forwards": [state[0] for state in states], "copied": []}
        report.append(entry)
        if entry["agreed"]:
            continue
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(tensor.data, src=0)
        # What trains it, by name: rank 0 says which, as the ranks' namespaces may differ.
        training = _training_state_of(model, namespace)
        sent = [{name: _on_cpu(value.state_dict()) for name, value in training.items()}]
        dist.broadcast_object_list(sent, src=0, group=group)
        for state_name, state in sent[0].items():
            if dist.get_rank() != 0 and state_name in training:
                training[state_name].load_state_dict(state)
        entry["copied"] = sorted(sent[0])
    return report
