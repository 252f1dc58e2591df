"""Sharded models come back whole: FSDP2 (``fully_shard``) and tensor parallel modules, their optimizers and bare
DTensors arrive in the notebook as plain CPU tensors of the user's own classes, equal element for element to the
ranks' ``full_tensor()``; what cannot be gathered is refused in one line."""
from __future__ import annotations

import inspect
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ddp_notebook
from ddp_notebook import JobStopped, RankError
from ddp_notebook.engine import pool, spec as job_spec
from ddp_notebook.rank import sharded
from nbrun import execute, kernel, run_until_pids

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(params=[(2, None), (3, "1")], ids=["2 ranks", "3 ranks, every tensor by shared memory"])
def warm(request, no_leftovers, monkeypatch):
    """A warm pool of 2 or 3 ranks: one test's examples share it (a pool starts in well under a second).  With 3
    ranks every tensor of a result is over the sharing threshold, so each whole copy is gathered straight into the
    notebook's results file."""
    ranks, min_bytes = request.param
    if min_bytes is not None:
        monkeypatch.setenv("DDP_NOTEBOOK_SHARE_MIN_BYTES", min_bytes)
    ranks = pool.Pool(job_spec.resolve_devices(cpus=ranks)).start()
    yield ranks
    ranks.stop()


def _trained(plan: dict):
    """Rank side: a generated model, sharded and trained as ``plan`` says; (model, optimizer, the ranks' full
    tensors: every parameter and buffer by name, the optimizer's state in its parameter order)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    class Stack(torch.nn.Module):
        def __init__(self, widths, tied, buffer):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
            last = widths[-1]
            if tied:
                self.head = torch.nn.Linear(last, last, bias=False)
                self.tail = torch.nn.Linear(last, last, bias=False)
                self.tail.weight = self.head.weight
            if buffer:
                self.register_buffer("scale", torch.linspace(0.5, 1.5, last))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            if hasattr(self, "head"):
                x = self.tail(self.head(x))
            return x * self.scale if hasattr(self, "scale") else x

    torch.manual_seed(plan["seed"])
    dtype = getattr(torch, plan["dtype"])
    model = Stack(plan["widths"], plan["tied"], plan["buffer"]).to(dtype)
    for index in plan["sharded_layers"]:
        fully_shard(model.layers[index])
    if plan["shard_root"]:
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, plan["widths"][0], dtype=dtype)
    for _ in range(2):
        model(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad()
    if plan["eval_last"]:  # leaves an FSDP2 root unsharded
        with torch.no_grad():
            model(x)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    tensors = {name: full(t) for name, t in [*model.named_parameters(remove_duplicate=False),
                                                 *model.named_buffers()]}
    state = [{key: full(value) for key, value in opt.state[p].items()} for p in opt.param_groups[0]["params"]]
    return model, opt, tensors, state


@st.composite
def _plans(draw):
    widths = draw(st.lists(st.integers(1, 7), min_size=2, max_size=4))  # uneven shards, dim 0 below the world size
    layers = len(widths) - 1
    sharded = draw(st.lists(st.integers(0, layers - 1), unique=True, max_size=layers))
    shard_root = draw(st.booleans())
    if not sharded and not shard_root:
        sharded = [0]
    return {"seed": draw(st.integers(0, 1000)), "widths": widths, "sharded_layers": sorted(sharded),
            "shard_root": shard_root, "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])),
            "tied": draw(st.booleans()), "buffer": draw(st.booleans()), "eval_last": draw(st.booleans())}


def _bitwise_equal(a, b) -> bool:
    """Equal element for element, NaNs (fp16 AdamW makes some) and the sign of zero included."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.detach().reshape(-1).view(torch.uint8),
                                                                      b.detach().reshape(-1).view(torch.uint8))


def _assert_whole(model, opt, tensors, state, plan):
    from torch.distributed.fsdp import FSDPModule

    assert type(model).__name__ == "Stack" and not isinstance(model, FSDPModule)
    assert all(type(m).__module__ == "torch.nn.modules.linear" for m in model.layers)
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    assert [name for name, _ in named] == list(tensors)
    for name, t in named:
        assert type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu", name
        assert _bitwise_equal(t, tensors[name]), name
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module
        assert not [key for key in vars(module) if "composable" in key or "fsdp" in key], module
    if plan["tied"]:
        assert model.tail.weight is model.head.weight
    params = opt.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    assert len(state) == len(params)
    for p, expected in zip(params, state):
        got = opt.state[p]
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert type(got[key]) is torch.Tensor and _bitwise_equal(got[key], value), key


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=_plans())
def test_a_sharded_model_and_its_optimizer_come_back_whole(warm, plan):
    results = ddp_notebook.launch(_trained, args=(plan,))
    model, opt, tensors, state = results[0]
    _assert_whole(model, opt, tensors, state, plan)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(2, plan["widths"][0], dtype=model.layers[0].weight.dtype)).float().sum().backward()
    opt.step()  # the returned optimizer steps the returned model
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    for other in results[1:]:  # the other ranks' values: rank 0's whole objects, not gathered again
        assert other[0] is model and other[1] is opt


def _state_dict_and_tensors(dims):
    import torch
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(*dims))
    state = model.state_dict()
    return state, {name: t.full_tensor() for name, t in state.items()}, [state["weight"], torch.ones(2)]


def _meeting_keys_left_by_the_task_before():
    from ddp_notebook.rank import context

    ctx = context.current()
    key = f"ddp_notebook/sharded/{ctx.task_id - 1}/0"
    names = [f"{key}/{name}" for name in ("arrived", "all", "read", *(f"rank{r}" for r in range(ctx.world_size)))]
    return [name for name in names if ctx.store.check([name])]


def test_a_state_dict_and_bare_dtensors_come_back_whole(warm):
    state, full, listed = ddp_notebook.launch(_state_dict_and_tensors, args=((5, 2),))[0]
    assert {name: type(t) for name, t in state.items()} == {"weight": torch.Tensor, "bias": torch.Tensor}
    assert all(torch.equal(state[name], full[name]) for name in full)
    assert listed[0] is state["weight"] and torch.equal(listed[1], torch.ones(2))
    # The ranks met in the job's store to agree on what they gather; the meeting's keys are gone.
    assert ddp_notebook.launch(_meeting_keys_left_by_the_task_before) == [[]] * warm.spec.world_size


def _tensor_parallel():
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Mlp(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(5, 6)  # (TP's hidden width divides among the ranks)
            self.down = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = parallelize_module(Mlp(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(4, 5)
    model(x).sum().backward()
    opt.step()
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return model, opt, full, x, model(x).detach()


def test_a_tensor_parallel_model_comes_back_whole_and_computes_the_same(warm):
    model, opt, full, x, output = ddp_notebook.launch(_tensor_parallel)[0]
    assert type(model).__name__ == "Mlp"
    assert {name: torch.equal(p, full[name]) for name, p in model.named_parameters()} == dict.fromkeys(full, True)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert all(type(opt.state[p]["momentum_buffer"]) is torch.Tensor for p in model.parameters())
    torch.testing.assert_close(model(x), output)  # TP's hooks gone, the plain forward is the same


def _fsdp1_trained(nested: bool, use_orig_params: bool):
    """Rank side: an FSDP1 model (the root wrapped, and its first layer too when ``nested``), trained; (model,
    optimizer, the ranks' full parameters by name, the full optimizer state by name, an input and its output)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(17, 33)  # 561 + 33 + 165 + 5 elements: uneven flat shards
            self.b = torch.nn.Linear(33, 5)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, 5))

        def forward(self, x):
            return self.b(torch.relu(self.a(x))) * self.scale

    torch.manual_seed(0)
    net = Net()
    if nested:
        net.a = FSDP(net.a, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    model = FSDP(net, device_id=torch.device("cpu"), use_orig_params=use_orig_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 17)
    for _ in range(2):
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model, writeback=False):
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
    state = {name: {key: value.clone() for key, value in held.items()}  # whole on every rank
             for name, held in FSDP.optim_state_dict(model, opt)["state"].items()}
    return model, opt, full, state, x, model(x).detach()


def _without_optimizer(nested: bool, use_orig_params: bool):
    model, opt, full, *_ = _fsdp1_trained(nested, use_orig_params)
    return model, full


def test_an_fsdp1_model_with_use_orig_params_comes_back_whole_and_its_optimizer_is_refused(warm):
    model, full = ddp_notebook.launch(_without_optimizer, args=(True, True))[0]
    assert type(model).__name__ == "Net" and type(model.a) is torch.nn.Linear
    assert {name: _bitwise_equal(p, full[name]) for name, p in model.named_parameters()} == dict.fromkeys(full, True)
    with pytest.raises(RankError, match=r"the return value\[1\] is the optimizer of an FSDP1 model with "
                                        r"use_orig_params=True, which cannot be returned whole"):
        ddp_notebook.launch(_fsdp1_trained, args=(True, True))


@pytest.mark.parametrize("nested", [False, True], ids=["root", "nested"])
def test_an_fsdp1_model_and_its_optimizer_come_back_whole(warm, nested):
    results = ddp_notebook.launch(_fsdp1_trained, args=(nested, False))
    model, opt, full, state, x, output = results[0]
    assert type(model).__name__ == "Net" and type(model.a) is torch.nn.Linear
    assert [name for name, _ in model.named_parameters()] == ["a.weight", "a.bias", "b.weight", "b.bias"]
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in model.parameters())
    assert {name: _bitwise_equal(p, full[name]) for name, p in model.named_parameters()} == dict.fromkeys(full, True)
    assert torch.equal(model.scale, torch.linspace(0.5, 1.5, 5))
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks, module
    torch.testing.assert_close(model(x), output)  # the plain forward computes what the ranks' FSDP1 model did
    params = opt.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(p) for p in model.parameters()]
    for name, p in model.named_parameters():
        assert set(opt.state[p]) == set(state[name]), name
        assert all(_bitwise_equal(opt.state[p][key], value) for key, value in state[name].items()), name
    before = model.a.weight.detach().clone()
    model(x).sum().backward()
    opt.step()  # the returned optimizer steps the returned model
    assert not torch.equal(before, model.a.weight)
    for other in results[1:]:
        assert other[0] is model and other[1] is opt


def _returns_sharded(how: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(4, 3))
    if how == "set":
        return {model.weight}
    if how == "rank 0 only":
        import os

        os.environ["DDP_NOTEBOOK_SHARDED_ARRIVAL_S"] = "3"  # (rank 0 waits that long for the others, then refuses)
        return model if dist.get_rank() == 0 else None
    if how == "fsdp1 optimizer":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(torch.nn.Linear(4, 3), device_id=torch.device("cpu"))
        return {"opt": torch.optim.SGD(wrapped.parameters(), lr=0.1)}
    return model


@pytest.mark.parametrize("how, message", [
    ("set", r"the return value is a set holding DTensors: a set has no order every rank shares to gather them in; "
            r"return them in a list or dict"),
    ("rank 0 only", r"the ranks return different sharded values, which cannot be gathered: rank 0 returns the return "
                    r"value, and (rank 1|ranks 1, 2) returned no sharded value within 3 s \(a rank may lag "
                    r"DDP_NOTEBOOK_SHARDED_ARRIVAL_S seconds\); return the same sharded values on every rank"),
    ("fsdp1 optimizer", r"the return value\['opt'\] is the optimizer of an FSDP1 model \(FullyShardedDataParallel\) "
                        r"that is not returned with it: its state is each rank's flat shard, made whole only through "
                        r"its model; return the model too, or FSDP.optim_state_dict\(model, optimizer\)"),
])
def test_what_cannot_be_gathered_is_refused_in_one_line(warm, how, message):
    with pytest.raises(RankError, match=message):
        ddp_notebook.launch(_returns_sharded, args=(how,))
    assert ddp_notebook.launch(_returns_sharded, args=("whole",))[0].weight.shape == (3, 4)  # the pool goes on


def _a_plain_result_recording_what_follows():
    # In a rank forked from the rank template, FSDP and DTensors are imported (sharded.in_use() is true); what
    # follows the return here (the task's end) is recorded into the returned list, which is pickled last.
    import torch
    import torch.distributed as dist
    import torch.distributed.tensor  # noqa: F401 - as the rank template does, whether or not this rank was forked

    from ddp_notebook.rank import context, sharded

    calls: list[str] = []

    def recording(name, original):
        def call(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return call

    for module in (dist, dist.distributed_c10d):
        for name in ("all_gather_object", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
                     "broadcast_object_list", "gather_object", "barrier", "_get_default_store"):
            if hasattr(module, name):
                setattr(module, name, recording(name, getattr(module, name)))

    class Store:
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            calls.append(f"store.{name}")
            return getattr(self.store, name)

    ctx = context.current()
    ctx.store = Store(ctx.store)
    return {"in_use": sharded.in_use(), "model": torch.nn.Linear(2, 2), "at the end": calls}


def test_a_plain_result_ends_the_task_with_no_collective_and_no_store_operation(no_leftovers):
    for out in ddp_notebook.launch(_a_plain_result_recording_what_follows, cpus=2):
        assert out["in_use"] and out["at the end"] == [] and out["model"].weight.shape == (2, 2)


def _rank_0_returns_a_sharded_model():
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(4, 3))
    return model if dist.get_rank() == 0 else "nothing sharded"


def test_a_sharded_model_only_rank_0_returns_is_refused_within_the_arrival_timeout(monkeypatch, no_leftovers):
    monkeypatch.setenv(sharded.ARRIVAL_TIMEOUT_ENV, "2")
    started = time.monotonic()
    with pytest.raises(RankError) as info:
        ddp_notebook.launch(_rank_0_returns_a_sharded_model, cpus=2)
    assert time.monotonic() - started < 45  # the 2 s, not the 60 s default, and no hang
    assert info.value.rank == 0
    assert ("the ranks return different sharded values, which cannot be gathered: rank 0 returns the return value, "
            "and rank 1 returned no sharded value within 2 s (a rank may lag DDP_NOTEBOOK_SHARDED_ARRIVAL_S "
            "seconds); return the same sharded values on every rank") in str(info.value)


def _waits_in_fsdp():
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    if dist.get_rank() == 1:
        time.sleep(600)  # the others wait for it in FSDP's all-gather of the forward
    model(torch.ones(1, 4))


def test_stacks_name_each_rank_while_the_others_wait_in_an_fsdp_all_gather(no_leftovers):
    lines, first = inspect.getsourcelines(_waits_in_fsdp)
    sleeping = first + next(i for i, line in enumerate(lines) if "time.sleep(600)" in line)
    forward = first + next(i for i, line in enumerate(lines) if "model(torch.ones" in line)
    job = ddp_notebook.launch(_waits_in_fsdp, cpus=3, background=True)
    try:
        here = "test_sharded_results.py"
        expected = (f"ranks 0, 2: all_gather_single ← _waits_in_fsdp ({here}:{forward})\n"
                    f"rank 1: _waits_in_fsdp ({here}:{sleeping})")
        deadline = time.monotonic() + 120
        stacks = job.stacks()
        while time.monotonic() < deadline and str(stacks) != expected:
            time.sleep(0.5)  # until every rank has loaded the task and reached its wait
            stacks = job.stacks()
        assert str(stacks) == expected, f"{stacks}\n(the job: {job.outcome})"  # ("no answer" twice in full runs)
        for rank in (0, 2):  # inside FSDP2's unshard of the forward
            assert {"foreach_all_gather", "unshard", "pre_forward"} <= {f.function for f in stacks.frames[rank]}
    finally:
        job.stop(now=True)
    with pytest.raises(JobStopped):
        job.wait()


NET_CELL = '''
import torch, ddp_notebook
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 33)
        self.b = torch.nn.Linear(33, 5)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))
'''

TRAIN_CELL = '''%%ddp --cpus 2 --return model, opt, full
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
model = Net()
fully_shard(model.a)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randn(64, 5))
loader = ddp_notebook.distributed_loader(data, batch_size=8)
for epoch in range(2):
    for x, y in loader:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        full = {name: p.full_tensor() for name, p in model.named_parameters()}
'''

CHECK_CELL = '''
assert type(model) is Net and all(type(p) is torch.nn.Parameter for p in model.parameters())
assert all(torch.equal(p, full[name]) for name, p in model.named_parameters())
assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())
print("WHOLE", type(model).__name__, tuple(model.a.weight.shape))
'''

# (on a copy: a warm pool sends the notebook's model to the ranks in place of theirs once the notebook changes it)
STEP_CELL = '''
import copy
stepped, stepped_opt = copy.deepcopy((model, opt))
before = stepped.a.weight.detach().clone()
stepped(torch.ones(2, 16)).sum().backward(); stepped_opt.step()
assert not torch.equal(before, stepped.a.weight)
print("STEPPED")
'''


@pytest.mark.kernel
def test_the_issue_repro_returns_the_fsdp2_model_whole_fresh_stopped_and_from_a_warm_pool(no_leftovers):
    with kernel("%load_ext ddp_notebook\n" + NET_CELL) as (km, kc):
        told = execute(kc, [TRAIN_CELL, CHECK_CELL, STEP_CELL])
        assert "WHOLE Net (33, 16)" in told and "STEPPED" in told and "Error" not in told, told

        # A graceful stop: the names assigned so far come back, gathered
        stopping = TRAIN_CELL.replace("range(2)", "range(1000)").replace("opt.zero_grad()", "opt.zero_grad()\n"
                                                                          "        time.sleep(0.02)")
        run_until_pids(kc, stopping.replace("--return model, opt, full\n", "--return model, opt, full\n"
                                            "import os, time\nprint('PID', os.getpid(), flush=True)\n", 1))
        time.sleep(3)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["ename"] == "CellStopped", reply["content"]
        assert "WHOLE Net (33, 16)" in execute(kc, [CHECK_CELL])

        # A warm pool's model comes back whole and stays sharded in the ranks
        told = execute(kc, ["%ddp_start --cpus 2", TRAIN_CELL.replace("--cpus 2 ", ""), CHECK_CELL,
                            "%%ddp\nfrom torch.distributed.tensor import DTensor\n"
                            "print('RANK-SIDE', rank, type(model).__name__, type(model.a.weight).__name__, "
                            "tuple(model.a.weight.to_local().shape))\n"
                            "model(torch.ones(2, 16)).sum().backward(); opt.step()\n"
                            "full = {name: p.full_tensor() for name, p in model.named_parameters()}",
                            "%%ddp --return model, opt, full\npass",
                            CHECK_CELL, "%ddp_stop"])
        assert told.count("WHOLE Net (33, 16)") == 2, told
        assert "RANK-SIDE 0 FSDPNet DTensor (17, 16)" in told and "RANK-SIDE 1 FSDPNet DTensor (16, 16)" in told, told


def _peak_growth_of_the_gather(width: int) -> tuple[int, int]:
    """Rank side: an FSDP2 model built sharded (never whole on any rank) gathered as at a task's end, into the
    notebook's results file; (bytes of the rank's memory at rest, how far its peak rose above that meanwhile)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from ddp_notebook.rank import context, sharded
    from ddp_notebook.wire import payload

    def kib(key):
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))

    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(4)))
    for layer in model:
        fully_shard(layer)
    model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p.to_local())
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from now
    at_rest = kib("VmRSS")
    ctx = context.current()
    store = payload.result_store(ctx.task.results_file)
    whole = sharded.whole_copies(model, "model", ctx.rank, ctx.world_size, allocate=store.new_tensor)
    growth = kib("VmHWM") - at_rest
    full = [p.full_tensor() for p in model.parameters()]  # (a collective: every rank)
    if ctx.rank == 0:
        assert all(torch.equal(a, b) for a, b in zip(whole[0][1].parameters(), full))
    return at_rest << 10, growth << 10


def test_the_gather_holds_the_model_once_on_rank_0_and_nothing_more_than_its_shard_elsewhere(no_leftovers):
    """Each rank sends its rows of every FSDP2 parameter straight into rank 0's copy, which is the notebook's
    results file: rank 0 never holds a second copy (no all-gather output, no pickled one), the other ranks nothing
    but their shards (a whole parameter would be a quarter of the model)."""
    width = 2048
    model_bytes = 4 * width * width * 4
    (_, rank0_growth), (_, rank1_growth) = ddp_notebook.launch(_peak_growth_of_the_gather, args=(width,), cpus=2)
    assert rank0_growth <= 1.1 * model_bytes, (rank0_growth, model_bytes)
    assert rank1_growth <= 0.1 * model_bytes, (rank1_growth, model_bytes)
