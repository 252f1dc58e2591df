"""What comes back from the ranks: wrapped models as the plain module (DDP and torch.compile in either order),
with the optimizer that steps them; results of a computation detached; the ranks' own objects untouched."""
from __future__ import annotations

import collections
import dataclasses
import pickle

import pytest
import torch

import ddp_notebook
from ddp_notebook.wire import payload
from nbrun import execute, kernel


def _trained(order):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    if order == "compile(DDP)":
        model = torch.compile(DDP(net), backend="eager")
    else:
        model = DDP(torch.compile(net, backend="eager"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(5, 4)).sum().backward()
    opt.step()
    return model, opt


def _steps_the_returned_model(model, opt):
    before = [p.detach().clone() for p in model.parameters()]
    model.zero_grad()
    model(torch.ones(5, 4)).sum().backward()
    opt.step()
    return all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("order", ["compile(DDP)", "DDP(compile)"])
@pytest.mark.slow
def test_a_wrapped_model_comes_back_plain_with_its_optimizer(no_leftovers, order):
    model, opt = ddp_notebook.launch(_trained, args=(order,), cpus=2)[0]
    assert type(model) is torch.nn.Sequential
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert all(opt.state[p]["momentum_buffer"] is not None for p in model.parameters())
    assert _steps_the_returned_model(model, opt)


@dataclasses.dataclass
class _Holder:
    state: dict
    pair: tuple


def test_results_anywhere_in_containers_come_back_detached_and_the_rank_keeps_its_objects(monkeypatch):
    leaf = torch.ones(3, requires_grad=True)
    computed = leaf * 2  # carries a graph
    Point = collections.namedtuple("Point", "x y")
    value = _Holder(collections.OrderedDict(w=computed), (Point(computed, 1), [computed]))
    model = torch.nn.Linear(2, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("a rank's object was moved")

    monkeypatch.setattr(torch.nn.Module, "cpu", refuse)  # the rank's objects are copied, never moved
    monkeypatch.setattr(torch.nn.Module, "to", refuse)
    back = pickle.loads(payload.dumps_result({"value": value, "model": model, "leaf": leaf}))
    got = back["value"]
    for t in (got.state["w"], got.pair[0].x, got.pair[1][0]):
        assert t.grad_fn is None and not t.requires_grad and t.tolist() == [2.0, 2.0, 2.0]
    assert got.pair[0].x is got.state["w"]  # one tensor still
    assert back["leaf"].requires_grad and isinstance(back["model"].weight, torch.nn.Parameter)
    assert computed.grad_fn is not None  # the rank's own tensor keeps its graph


CELLS = """
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(x)
"""

DDP_CELL = """%%ddp --cpus 2 --return model,opt
torch.manual_seed(0)
model = torch.compile(DDP(Net()), backend="eager")
opt = torch.optim.Adam(model.parameters(), lr=0.1)
model(torch.ones(3, 4)).sum().backward()
opt.step()
"""

CHECK = """
w = model.fc.weight.detach().clone()
model(torch.ones(3, 4)).sum().backward()
opt.step()
print("returned:", type(model).__name__, opt.param_groups[0]["params"][0] is model.fc.weight,
      not torch.equal(w, model.fc.weight))
"""


@pytest.mark.slow
@pytest.mark.kernel
def test_return_of_a_compiled_ddp_model_in_a_cell(no_leftovers):
    with kernel() as (km, kc):
        shown = execute(kc, [CELLS, DDP_CELL, CHECK])
    assert "returned: Net True True" in shown, shown
