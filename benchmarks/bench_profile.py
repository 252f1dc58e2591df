"""Benchmark of ``--profile`` (not a test): what profiling costs a DDP training loop.

The same DDP loop on 2 CPU ranks (gloo) runs as ``launch(train, cpus=2)`` jobs with and without
``profile=True`` (the default window: 10 steps after 5), alternating ABBA.  Measured:

- the profiled window's steps (steps 6 to 15, by the rank's own clock) against the same steps unprofiled;
- the whole loop in the rank (every step; the profiler starts, records 10 steps and stops inside it);
- the whole ``launch()`` in the notebook: the trace's export in each rank, sending, merging, writing and the
  breakdown included.

    .venv/bin/python benchmarks/bench_profile.py [--pairs 4] [--steps 60]

Prints a Markdown summary; figures of a run are kept in benchmarks/RESULTS_profile.md.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def train(steps: int):
    """A small DDP MLP over ``distributed_loader``; each step's wall time (rank's perf_counter)."""
    import time

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import TensorDataset

    from ddp_notebook import distributed_loader

    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(2 * 32 * steps, 256), torch.randn(2 * 32 * steps, 1))
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    started = time.perf_counter()
    for x, y in distributed_loader(data, batch_size=32):
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        now = time.perf_counter()
        times.append(now - started)
        started = now
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    import ddp_notebook
    from ddp_notebook.engine.profiling import ProfileOptions

    window = ProfileOptions()
    first, last = window.skip, window.skip + 1 + window.steps  # times[first:last]: the warm-up step, the recorded
    runs: dict[bool, list[dict]] = {False: [], True: []}
    folder = tempfile.mkdtemp(prefix="bench_profile_")
    ddp_notebook.launch(train, (8,), cpus=2)  # (the rank template warm, torch imported)
    for pair in range(args.pairs):
        for profiled in ((False, True, True, False) if pair % 2 == 0 else (True, False, False, True)):
            with contextlib.redirect_stdout(io.StringIO()):  # (the breakdown printed under each profiled job)
                started = time.perf_counter()
                times = ddp_notebook.launch(train, (args.steps,), cpus=2, profile=profiled or None,
                                            log_dir=folder)
                launch_s = time.perf_counter() - started
            runs[profiled].append({"launch": launch_s,
                                   "window": max(sum(t[first:last]) for t in times),
                                   # a recorded step's own cost: not the profiler's start (the warm-up step) nor
                                   # the trace's export (in the last recorded step)
                                   "step": max(statistics.median(t[first + 1:last - 1]) for t in times),
                                   "loop": max(sum(t) for t in times)})
    print(f"# --profile benchmark\n\n`benchmarks/bench_profile.py --pairs {args.pairs} --steps {args.steps}`: "
          f"a DDP MLP (256→512→1, batches of 32) on 2 CPU ranks (gloo), {args.steps} loader steps a job, "
          f"jobs with and without `profile=True` alternating ABBA; medians over {2 * args.pairs} jobs each; "
          f"the slower rank's figure per job.\n")
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f} at the end.\n")
    print("| measure | without | with --profile | ratio |\n|---|---|---|---|")
    for key, label in (("step", f"median step inside the window (steps {first + 2}–{last - 1})"),
                       ("window", f"the profiled window: steps {first + 1}–{last} (1 warm-up + {window.steps} "
                                  f"recorded; the trace's export in the last)"),
                       ("loop", f"the whole loop ({args.steps} steps), in the rank"),
                       ("launch", "the whole launch(), in the notebook (export, merge, analysis included)")):
        plain = statistics.median(r[key] for r in runs[False])
        profiled = statistics.median(r[key] for r in runs[True])
        print(f"| {label} | {plain:.3f} s | {profiled:.3f} s | ×{profiled / plain:.2f} |")


if __name__ == "__main__":
    main()
