"""Checkpoints written in the background on 2 CPU ranks: how long the training is blocked by
``save_checkpoint(..., background=True)`` against a blocking ``save_checkpoint`` of the same ~1 GiB state, and the
steps per second of a loop that saves every N steps in the background against the same loop that never saves;
DDP and FSDP2.

``python benchmarks/bench_checkpoint.py [--mib 1024] [--repeats 5] [--loop-mib 256] [--every 10] [--segments 2]``
prints one JSON object (RESULTS_checkpoint.md is written from it).  ``BENCH_CHECKPOINT_DIR`` picks the folder saved
into (default: the system's temporary folder).

- blocked: the same ranks alternate a blocking and a background save of the model and its AdamW state (layers of
  ``Linear(4096, 4096)``: weights, ``exp_avg`` and ``exp_avg_sq``, ``--mib`` MiB in all) to one path each (the
  order flips every repeat; a first round warms up: imports, the staging copy's first allocation, not counted).
  A call's blocked time is the longest of the ranks' (the training goes on at the slowest rank's pace); after each
  call every rank waits for the write to end, untimed, so no write overlaps the next call.  The ratio is of the
  medians.  The floor: each rank copying what its background save stages (a DDP model's rank 0 the whole state, an
  FSDP2 rank its shards) into buffers allocated before (``copy_``), what any staging copy costs here.
- loop (a ``--loop-mib`` state: a CPU step of the 1 GiB one takes seconds here): segments of ``3 * every`` training
  steps (forward, backward, AdamW step), alternately saving in the
  background every ``every`` steps (the first save half-way through the first ``every``), never saving, and only
  copying the state as often (the floor: the staging copy without the write); a segment's time includes waiting for
  its last write.  The ratios are of the median steps per second.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

WIDTH = 4096  # a Linear(WIDTH, WIDTH) layer: 64 MiB of fp32 weights


def _model(kind: str, mib: int):
    """Rank side: layers of WIDTH x WIDTH weights whose weights and AdamW state (3 copies) make ``mib`` MiB; one
    step made, so the optimizer's state exists."""
    import torch

    layers = max(1, round(mib * 2**20 / 3 / (WIDTH * WIDTH * 4)))
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            fully_shard(layer)
        model = fully_shard(net)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, optimizer)
    return model, optimizer


def _step(model, optimizer) -> None:
    import torch

    optimizer.zero_grad()
    model(torch.randn(8, WIDTH)).square().mean().backward()
    optimizer.step()


def _local_tensors(model, optimizer) -> list:
    tensors = [p.detach() for p in model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if hasattr(v, "untyped_storage")]
    return [getattr(t, "_local_tensor", t) for t in tensors]


def _blocked_task(kind: str, mib: int, repeats: int, folder: str) -> dict:
    import time

    import torch
    import torch.distributed as dist

    import ddp_notebook
    from ddp_notebook.rank import background_saves

    model, optimizer = _model(kind, mib)
    times: dict[str, list[float]] = {"blocking": [], "background": [], "floor": []}
    # What this rank's background save stages: a DDP model's rank 0 the whole state, each FSDP2 rank its shards.
    tensors = _local_tensors(model, optimizer) if kind == "fsdp2" or dist.get_rank() == 0 else []
    buffers = [torch.empty_like(t) for t in tensors]
    order = ["blocking", "background"]
    for repeat in range(repeats + 1):
        for name in (order if repeat % 2 == 0 else order[::-1]):
            path = os.path.join(folder, f"{kind}-{name}")
            dist.barrier()
            started = time.perf_counter()
            ddp_notebook.save_checkpoint(path, model, optimizer, repeat, background=name == "background")
            blocked = time.perf_counter() - started
            background_saves.wait(path)
            dist.barrier()
            if repeat:
                times[name].append(blocked)
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor)
        if repeat:
            times["floor"].append(time.perf_counter() - started)
    state_bytes = sum(t.untyped_storage().nbytes() for t in _local_tensors(model, optimizer))
    return {"times": times, "state_bytes": state_bytes}


def _loop_task(kind: str, mib: int, every: int, segments: int, folder: str) -> dict:
    import time

    import torch.distributed as dist

    import ddp_notebook
    from ddp_notebook.rank import background_saves

    import torch

    model, optimizer = _model(kind, mib)
    path = os.path.join(folder, f"{kind}-loop")
    steps = 3 * every
    rates: dict[str, list[float]] = {"saving": [], "never": [], "copying": []}
    order = ["never", "saving", "copying"]
    tensors = _local_tensors(model, optimizer) if kind == "fsdp2" or dist.get_rank() == 0 else []
    buffers = [torch.empty_like(t) for t in tensors]
    for segment in range(segments + 1):  # the first pair warms up
        for name in (order if segment % 2 == 0 else order[::-1]):
            dist.barrier()
            started = time.perf_counter()
            for step in range(steps):  # (a rank saving or copying more than the other makes both wait for it)
                _step(model, optimizer)
                if name == "saving" and step % every == every // 2:
                    ddp_notebook.save_checkpoint(path, model, optimizer, step, background=True)
                elif name == "copying" and step % every == every // 2:  # the floor: the staging copy, no write
                    for buffer, tensor in zip(buffers, tensors):
                        buffer.copy_(tensor)
            background_saves.wait(path)
            dist.barrier()
            if segment:
                rates[name].append(steps / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="the state's size (weights and AdamW state), MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--loop-mib", type=int, default=256, help="the loop's state, MiB")
    parser.add_argument("--every", type=int, default=10, help="the loop saves every this many steps")
    parser.add_argument("--segments", type=int, default=2, help="the loop's segments of each kind")
    parser.add_argument("--kinds", default="ddp,fsdp2")
    parser.add_argument("--parts", default="blocked,loop")
    args = parser.parse_args()

    import ddp_notebook

    out: dict = {"mib": args.mib, "loop_mib": args.loop_mib, "every": args.every}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_CHECKPOINT_DIR")) as folder:
        out["folder"] = folder
        for kind in args.kinds.split(","):
            if "blocked" in args.parts:
                ranks = ddp_notebook.launch(_blocked_task, (kind, args.mib, args.repeats, folder), cpus=2)
                # A call blocks the training as long as its slowest rank.
                times = {name: [max(r["times"][name][i] for r in ranks) for i in range(args.repeats)]
                         for name in ranks[0]["times"]}
                medians = {name: statistics.median(v) for name, v in times.items()}
                least = {name: min(v) for name, v in times.items()}
                out[f"{kind} blocked"] = {
                    "state_mib_per_rank": [r["state_bytes"] / 2**20 for r in ranks],
                    "seconds": times, "median_s": medians,
                    "ratio": medians["background"] / medians["blocking"],
                    "floor_ratio": medians["floor"] / medians["blocking"],
                    "ratio_of_minimums": least["background"] / least["blocking"],
                }
            if "loop" in args.parts:
                ranks = ddp_notebook.launch(_loop_task, (kind, args.loop_mib, args.every, args.segments, folder), cpus=2)
                rates = ranks[0]
                medians = {name: statistics.median(v) for name, v in rates.items()}
                out[f"{kind} loop"] = {"steps_per_s": rates, "median": medians,
                                       "ratio": medians["saving"] / medians["never"],
                                       "floor_ratio": medians["copying"] / medians["never"]}
            print(json.dumps({k: v for k, v in out.items() if k.startswith(kind)}), flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
