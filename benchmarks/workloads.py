"""What the benchmarks run, each importable (launch() ships these by reference) and runnable as a script.

``python benchmarks/workloads.py MODE ...``; the driver is ``benchmarks/run.py``.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the trivial job: init, one all_reduce, exit ------------------------------------------------------


def trivial() -> float:
    """Under launch(): the process group is up already."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def trivial_self_init(rank: int | None = None, world_size: int = 2) -> None:
    """Under torchrun, mp.spawn and notebook_launcher: the function sets the group up itself."""
    import torch
    import torch.distributed as dist

    if rank is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()


def _spawned(rank: int) -> None:
    trivial_self_init(rank)


# -- throughput: a small CNN on synthetic data -----------------------------------------------------------


def cnn_throughput(steps: int = 100, warmup: int = 10, batch: int = 64) -> dict:
    """Samples per second of the same DDP training loop, timed inside the ranks after a warm-up."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    ))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    elapsed = time.perf_counter() - started
    return {"samples_per_s": steps * batch * dist.get_world_size() / elapsed, "threads": torch.get_num_threads(),
            "omp": os.environ.get("OMP_NUM_THREADS")}


# -- memory: a 1 GiB TensorDataset, 2 ranks, 2 epochs ------------------------------------------------------


def memory_train(ds, epochs: int = 2, batch: int = 512) -> dict:
    """Two epochs over the dataset with a DistributedSampler; when the first batch arrived."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    first = None
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler)
    model = DDP(nn.Linear(ds.tensors[0][0].numel(), 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if first is None:
                first = time.time()
            opt.zero_grad()
            loss_fn(model(xb.flatten(1)), yb).backward()
            opt.step()
    dist.barrier()
    return {"first_batch": first}


def memory_train_small(ds, epochs: int = 2, batch: int = 65536) -> dict:
    """Two epochs over millions of small samples through ``distributed_loader``; when the first batch arrived."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_notebook

    first = None
    loader = ddp_notebook.distributed_loader(ds, batch_size=batch, progress=False)
    model = DDP(nn.Linear(ds.tensors[0].shape[1], 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for xb, yb in loader:
            if first is None:
                first = time.time()
            opt.zero_grad()
            nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
    dist.barrier()
    return {"first_batch": first}


def _train(ds):
    return memory_train_small(ds) if ds.tensors[0].dim() == 2 else memory_train(ds)


def _forked(rank: int, ds, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    result = _train(ds)
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def make_dataset(nbytes: int, shape: str = "large"):
    """``large``: 32x32x3 images and labels (87 k of them in 1 GiB); ``small``: 63 features and a target
    (4.2 M in 1 GiB)."""
    import torch
    from torch.utils.data import TensorDataset

    if shape == "small":
        n = nbytes // (64 * 4)
        return TensorDataset(torch.randn(n, 63), torch.randn(n, 1))
    n = nbytes // (3 * 32 * 32 * 4)
    return TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))


def memory_notebook(mode: str, nbytes: int, out: str, shape: str = "large") -> None:
    """The 'notebook' of the memory benchmark: make the dataset, then train on 2 ranks by ``mode``."""
    if mode == "naive":
        os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = "off"
    if mode == "shared-ext":  # what ``%load_ext ddp_notebook`` in the notebook's first cell does
        from ddp_notebook.engine import template

        template.warm_up()
    ds = make_dataset(nbytes, shape)
    made = time.time()
    if mode in ("shared", "shared-ext", "naive"):
        import ddp_notebook

        called = time.time()
        firsts = [r["first_batch"] for r in ddp_notebook.launch(_train, (ds,), cpus=2)]
    else:
        import tempfile

        import torch.multiprocessing as mp

        called = time.time()
        with tempfile.TemporaryDirectory() as out_dir:
            mp.start_processes(_forked, args=(ds, free_port(), out_dir), nprocs=2, start_method="fork")
            firsts = []
            for rank in range(2):
                with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
                    firsts.append(json.load(f)["first_batch"])
    with open(out, "w") as f:
        json.dump({"made": made, "called": called, "first_batch": min(firsts), "ended": time.time()}, f)


# -- dump and load of the 1 GiB dataset ----------------------------------------------------------------------


def dump_load(nbytes: int, out: str) -> None:
    import subprocess

    from ddp_notebook.wire import payload
    from ddp_notebook.wire import sharing

    ds = make_dataset(nbytes)
    result = {}
    kept = []
    for label, env in (("shared (first: moved)", None), ("shared (again)", None), ("naive cloudpickle", "off")):
        if env:
            os.environ["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = env
        task = payload.CallTask(len, (ds,), {}, False, payload.Sources())
        started = time.perf_counter()
        data = payload.dumps(task)
        dumped = time.perf_counter() - started
        sharing.settle()  # a first move finishes on a thread, beside the ranks' start-up
        settled = time.perf_counter() - started
        path = os.path.join(os.path.dirname(out), f"payload-{len(kept)}.pkl")
        with open(path, "wb") as f:
            f.write(data)
        kept.append(data)
        loaded = subprocess.run([sys.executable, __file__, "load", path], capture_output=True, text=True, check=True)
        result[label] = {"dump_s": dumped, "settled_s": settled, "payload_bytes": len(data),
                         **json.loads(loaded.stdout.splitlines()[-1])}
        os.unlink(path)
        os.environ.pop("DDP_NOTEBOOK_SHARE_MIN_BYTES", None)
    for data in kept:
        payload.release(data)
    with open(out, "w") as f:
        json.dump(result, f)


def load_once(path: str) -> None:
    import torch  # noqa: F401  (a rank has torch imported before it loads the payload)

    from ddp_notebook.wire import payload

    started = time.perf_counter()
    task = payload.load(path)
    loaded = time.perf_counter() - started
    float(task.args[0].tensors[0].sum())  # every byte read once
    print(json.dumps({"load_s": loaded, "load_and_read_s": time.perf_counter() - started}))


# -- report() --------------------------------------------------------------------------------------------


def report_cost(calls: int = 5000) -> float:
    """Microseconds per ``report()`` call inside a rank."""
    from ddp_notebook import report

    report(loss=0.0, step=0)
    started = time.perf_counter()
    for i in range(calls):
        report(loss=float(i), step=i + 1)
    return (time.perf_counter() - started) / calls * 1e6


# -- a long-lived caller, like a notebook kernel ----------------------------------------------------------


def _lightning_trivial(fabric) -> None:
    import torch

    fabric.all_reduce(torch.ones(1))


def caller(kind: str) -> None:
    """Read 'go' lines; answer each with the seconds one trivial 2-rank job took from this live process.

    ``launch``: the rank template stays warm between calls (as in a kernel); ``launch-template-cold``: it is
    stopped before each call, so the call starts one and waits for it; ``launch-no-template``: ranks started
    fresh (``DDP_NOTEBOOK_TEMPLATE=0``).  The environment changed before each call (only the ``launch()`` timed):
    ``launch-user-variable`` a variable of the user's; ``launch-after-accelerate`` accelerate's ``notebook_launcher``
    runs first (it leaves ``TORCHELASTIC_SIGNALS_TO_HANDLE`` set); ``launch-torch-variable`` and
    ``launch-no-template-torch-variable`` a variable libtorch reads as it loads (``TORCH_CPP_LOG_LEVEL``), with the
    template (a new one each call, whose preloads are waited for untimed) and with fresh ranks.
    """
    if kind.startswith("launch"):
        import ddp_notebook
        from ddp_notebook.engine import template

        if kind.startswith("launch-no-template"):
            os.environ["DDP_NOTEBOOK_TEMPLATE"] = "0"
        if kind == "launch-after-accelerate":
            from accelerate import notebook_launcher
        calls = iter(range(1 << 30))

        def once():
            n = next(calls)
            if kind == "launch-template-cold":
                template.stop()
            elif kind == "launch-user-variable":
                os.environ["WANDB_PROJECT"] = f"run-{n}"
            elif kind == "launch-after-accelerate":
                notebook_launcher(trivial_self_init, (), num_processes=2, use_port=str(free_port()))
            elif kind.endswith("torch-variable"):
                os.environ["TORCH_CPP_LOG_LEVEL"] = ("WARNING", "ERROR")[n % 2]
            started = time.perf_counter()
            ddp_notebook.launch(trivial, cpus=2)
            took = time.perf_counter() - started
            if kind == "launch-torch-variable":
                template.current().wait_preloaded()  # its preloads must not weigh on the next contender
            return took
    elif kind == "lightning":
        from lightning.fabric import Fabric

        def once():
            os.environ["MASTER_PORT"] = str(free_port())
            Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook").launch(_lightning_trivial)
    else:
        from accelerate import notebook_launcher

        def once():
            notebook_launcher(trivial_self_init, (), num_processes=2, use_port=str(free_port()))
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        started = time.perf_counter()
        took = once()
        print(f"took {time.perf_counter() - started if took is None else took:.6f}", flush=True)


def main(argv: list[str]) -> None:
    mode = argv[0]
    if mode == "launch-once":
        import ddp_notebook

        ddp_notebook.launch(trivial, cpus=2)
    elif mode == "spawn-trivial":
        import torch.multiprocessing as mp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        mp.spawn(_spawned, nprocs=2)
    elif mode == "accelerate-trivial":
        from accelerate import notebook_launcher

        notebook_launcher(trivial_self_init, (), num_processes=2, use_port=str(free_port()))
    elif mode == "torchrun-trivial":
        trivial_self_init()
    elif mode == "torchrun-cnn":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        result = cnn_throughput(*map(int, argv[2:5]))
        if dist.get_rank() == 0:
            with open(argv[1], "w") as f:
                json.dump(result, f)
        dist.destroy_process_group()
    elif mode == "launch-cnn":
        import ddp_notebook

        result = ddp_notebook.launch(cnn_throughput, tuple(map(int, argv[2:5])), cpus=2)[0]
        with open(argv[1], "w") as f:
            json.dump(result, f)
    elif mode == "launch-report":
        import ddp_notebook

        with open(argv[1], "w") as f:
            json.dump(ddp_notebook.launch(report_cost, cpus=2), f)
    elif mode == "memory":
        memory_notebook(argv[1], int(argv[2]), argv[3], *argv[4:5])
    elif mode == "dump-load":
        dump_load(int(argv[1]), argv[2])
    elif mode == "load":
        load_once(argv[1])
    elif mode == "caller":
        caller(argv[1])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    # Run through the module, so launch(), mp.spawn and torchrun's ranks all find the same functions by name.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import workloads

    workloads.main(sys.argv[1:])
