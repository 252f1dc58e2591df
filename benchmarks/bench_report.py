"""Benchmark of live metrics (not a test).

1. The cost of one ``report()`` call inside a rank (the training loop's share:
   building the event and a queue put), and how fast the rank's sender thread
   drains the queue to the notebook.
2. The same loop measured in this process, as one rank whose channel ends in
   a process that only receives: the rank's own share, without a notebook.
3. The slowdown of a training loop of ~1 ms steps that reports every step
   (1,000 reports a second per rank) while the notebook reduces the reports and
   draws the live dashboard, against the same loop without ``report()``.
   Blocks with and without reporting alternate (ABBA) inside one job, in a real
   Jupyter kernel (nbclient), so the widget dashboard really renders.
4. ``--mlp``: a 2-layer MLP under DDP on 2 CPU ranks in a real kernel with the
   extension loaded and the dashboard shown as users have it, ``report()``
   every step, against the same loop without, as separate jobs that alternate
   (ABBA): the loop's time ratio and the kernel's CPU while the loop runs
   (psutil ``cpu_times`` of the kernel, read by rank 0 before and after the
   loop), medians; then the kernel's memory (PSS and RSS, read from outside,
   after a warm-up job) over one long reporting run.  ``--package PATH``
   imports ``ddp_notebook`` from another checkout in the kernel (the code
   before a change, for a side by side).
5. ``--mlp-blocks``: the loop of part 4 in one job whose blocks of steps take
   turns, in a shuffled order each round, among three arms: no call, a call
   of a no-op function with report()'s arguments, and ``report()``.  Adjacent
   blocks share the machine's state of the moment, so the ratio of a round's
   reporting block to its plain block resolves a few percent where separate
   jobs do not; the no-op arm against the plain one is the design's own noise
   (an A/A comparison), measured in the same rounds.  ``--loader``: the
   same MLP fed by a loader, a block an epoch of 1,000 batches of 32, the
   arms a torch ``DataLoader`` with a ``DistributedSampler`` (the ``mp.spawn``
   recipe's), a ``distributed_loader`` (timed batches, the graceful stop's
   boundaries) and a ``distributed_loader`` with ``report()`` every step.
   ``--before-report REV``: a fourth arm, the ``report()`` of another git
   revision imported beside today's in the same ranks (its own batches and
   sender work): a change to ``report()`` measured in the same rounds.

    .venv/bin/python benchmarks/bench_report.py [--ranks 1 2] [--block-s 2] [--pairs 4]
    .venv/bin/python benchmarks/bench_report.py --mlp [--mlp-steps 4000] [--mlp-pairs 3] [--long-steps 100000]
    .venv/bin/python benchmarks/bench_report.py --mlp-blocks [--loader | --before-report REV] [--block-steps 1000] [--rounds 30]

Prints a Markdown summary; figures of a run are kept in benchmarks/RESULTS_report.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

PER_CALL = """\
%%ddp --cpus 1
import json, time
from ddp_notebook import report, progress, rank_context
calls = 100_000
started, cpu = time.perf_counter(), time.thread_time()
for i in range(calls):
    report(step=i, loss=0.5, acc=0.9)
report_s, report_cpu_s = (time.perf_counter() - started) / calls, (time.thread_time() - cpu) / calls
started = time.perf_counter()
rank_context().sender.flush()
drain_s = time.perf_counter() - started
started = time.perf_counter()
for i in range(calls):
    progress(i, calls)
progress_s = (time.perf_counter() - started) / calls
print("RESULT", json.dumps({"report_us": report_s * 1e6, "report_cpu_us": report_cpu_s * 1e6, "drain_s": drain_s,
                            "progress_us": progress_s * 1e6, "calls": calls}))
"""


# Steps of ~1 ms of single-threaded torch work; blocks with and without report() alternate ABBA, all ranks
# together.  Per block: wall time, this rank's CPU time (all its threads: the loop and the sender), the
# CPU time of the notebook's kernel (the rank's parent), which reduces the reports and draws, and the CPU
# time of the loop's own thread (report() calls; unlike wall time, not blurred by other processes).
SLOWDOWN = """\
%%ddp --cpus {ranks}
import json, os, time, psutil, torch
import torch.distributed as dist
from ddp_notebook import report
torch.set_num_threads(1)
torch.manual_seed(rank)
a, b = torch.randn(64, 64), torch.randn(64, 64) / 8
kernel = psutil.Process(os.getppid())

def step(repeats):
    c = a
    for _ in range(repeats):
        c = torch.tanh(c @ b)
    return float(c[0, 0])

repeats = 1
while True:  # calibrate one step to about 1 ms
    started = time.perf_counter()
    for _ in range(200):
        step(repeats)
    if (time.perf_counter() - started) / 200 >= 1e-3:
        break
    repeats += 1
steps = int({block_s} / ((time.perf_counter() - started) / 200))
x = 0

def block(reporting):
    global x
    dist.barrier()
    kernel_cpu = sum(kernel.cpu_times()[:2])
    started, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        loss = step(repeats)
        x += 1
        if reporting:
            report(step=x, loss=loss, acc=0.5)
    return (time.perf_counter() - started, time.process_time() - cpu, sum(kernel.cpu_times()[:2]) - kernel_cpu,
            time.thread_time() - loop_cpu)

blocks = {{"plain": [], "report": []}}
for pair in range({pairs}):
    for reporting in ((False, True, True, False) if pair % 2 == 0 else (True, False, False, True)):
        blocks["report" if reporting else "plain"].append(block(reporting))
print("RESULT", json.dumps({{"rank": rank, "steps": steps, "repeats": repeats, "blocks": blocks}}))
"""


# The model of parts 4 and 5: a 2-layer MLP under DDP on one thread a rank; ``kernel``, the kernel's process.
_MLP_MODEL = """\
import torch.nn.functional as F
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from ddp_notebook import report
torch.set_num_threads(1)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
inputs, targets = torch.randn(32, 32), torch.randn(32, 1)
kernel = psutil.Process({kernel_pid})

def train_step():
    optimizer.zero_grad()
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()
"""

# The loop of part 4: one job, with or without report() every step.  Rank 0 reads the kernel's CPU time around
# the loop (the ranks' parent is not always the kernel: its pid is written in).
MLP = """\
%%ddp --cpus 2
import json, time, psutil, torch
""" + _MLP_MODEL + """\

for _ in range(50):
    train_step()
dist.barrier()
kernel_cpu, started = sum(kernel.cpu_times()[:2]), time.perf_counter()
for step in range({steps}):
    loss = train_step()
    if {reporting}:
        report(step=step, steps={steps}, loss=loss)
dist.barrier()
loop_s, kernel_s = time.perf_counter() - started, sum(kernel.cpu_times()[:2]) - kernel_cpu
if rank == 0:
    print("RESULT", json.dumps({{"loop_s": loop_s, "kernel_cpu_s": kernel_s}}))
"""

# Part 5: the same loop in one job, blocks taking turns among three arms in a shuffled order a round (the
# same order on every rank: a seeded generator).  Rank 0 measures each block's wall time (DDP keeps the ranks
# in step) and the kernel's CPU; every rank its own CPU time (all threads: the loop and the sender).
MLP_BLOCKS = """\
%%ddp --cpus 2
import json, random, time, psutil, torch
""" + _MLP_MODEL + """
front = psutil.Process(kernel.ppid())  # the front end: here the benchmark's own process (a Jupyter client)

def nothing(**metrics):
    pass

calls = {{"plain": None, "noop": nothing, "report": report}}
{before_arm}
total = {rounds} * len(calls) * {block_steps}
for _ in range(200):
    train_step()
blocks = {{arm: [] for arm in calls}}
step = 0
for round_ in range({rounds}):
    arms = list(calls)
    random.Random(round_).shuffle(arms)
    for arm in arms:
        call = calls[arm]
        dist.barrier()
        front_cpu = sum(front.cpu_times()[:2])
        kernel_cpu, cpu, loop_cpu = sum(kernel.cpu_times()[:2]), time.process_time(), time.thread_time()
        started = time.perf_counter()
        if call is None:
            for _ in range({block_steps}):
                loss = train_step()
                step += 1
        else:
            for _ in range({block_steps}):
                loss = train_step()
                step += 1
                call(step=step, steps=total, loss=loss)
        blocks[arm].append((time.perf_counter() - started, time.process_time() - cpu,
                            sum(kernel.cpu_times()[:2]) - kernel_cpu, sum(front.cpu_times()[:2]) - front_cpu,
                            time.thread_time() - loop_cpu))
with open({out!r} + f"-{{rank}}.json", "w") as handle:  # (a long line printed would reach the notebook trimmed)
    json.dump(blocks, handle)
"""
# --before-report REV: a fourth arm, the report() of another revision, imported beside today's in the same ranks
BEFORE_ARM = """\
from ddp_notebook.rank import metrics_before
calls["before"] = metrics_before.report"""

# Part 5 with a loader (``--loader``): the same blocks, each an epoch of its arm's loader.  "plain" is torch's
# DataLoader with a DistributedSampler, "noop" a distributed_loader, "report" a distributed_loader with report()
# every step.
MLP_LOADER_BLOCKS = """\
%%ddp --cpus 2
import json, random, time, psutil, torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
import ddp_notebook
""" + _MLP_MODEL + """
front = psutil.Process(kernel.ppid())
total = {rounds} * 3 * {block_steps}
data = TensorDataset(torch.randn(32 * {block_steps} * world_size, 32), torch.randn(32 * {block_steps} * world_size, 1))
loaders = {{"plain": DataLoader(data, batch_size=32, sampler=DistributedSampler(data)),
            "noop": ddp_notebook.distributed_loader(data, batch_size=32),
            "report": ddp_notebook.distributed_loader(data, batch_size=32)}}

def train_on(x, y):
    optimizer.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    return loss.item()

for arm in loaders:  # warm-up: an epoch of each
    for x, y in loaders[arm]:
        train_on(x, y)
blocks = {{arm: [] for arm in loaders}}
step = 0
for round_ in range({rounds}):
    arms = list(loaders)
    random.Random(round_).shuffle(arms)
    for arm in arms:
        dist.barrier()
        front_cpu = sum(front.cpu_times()[:2])
        kernel_cpu, cpu, started = sum(kernel.cpu_times()[:2]), time.process_time(), time.perf_counter()
        if arm == "report":
            for x, y in loaders[arm]:
                loss = train_on(x, y)
                step += 1
                report(step=step, steps=total, loss=loss)
        else:
            for x, y in loaders[arm]:
                loss = train_on(x, y)
                step += 1
        blocks[arm].append((time.perf_counter() - started, time.process_time() - cpu,
                            sum(kernel.cpu_times()[:2]) - kernel_cpu, sum(front.cpu_times()[:2]) - front_cpu))
with open({out!r} + f"-{{rank}}.json", "w") as handle:
    json.dump(blocks, handle)
"""


def _bootstrap_mean(values: list, draws: int = 10_000) -> tuple:
    """The mean of ``values`` and its 95% bootstrap interval (a seeded generator: the same figures each time)."""
    import random

    generator = random.Random(0)
    means = sorted(statistics.fmean(generator.choices(values, k=len(values))) for _ in range(draws))
    return statistics.fmean(values), means[int(draws * 0.025)], means[int(draws * 0.975) - 1]


def _bootstrap_summed_ratio(arm: list, baseline: list, draws: int = 10_000) -> tuple:
    """The arm's total time over the baseline's, the rounds paired (what the loop as a whole pays), and its 95%
    bootstrap interval, rounds resampled (seeded).  The mean of per-round ratios leans high where the baseline's
    blocks are noisy (a slow baseline block makes a small ratio, a fast one a large ratio, and the large ones weigh
    more): the A/A arm shows by how much."""
    import random

    generator = random.Random(0)
    rounds = range(len(arm))
    ratios = []
    for _ in range(draws):
        picked = generator.choices(rounds, k=len(arm))
        ratios.append(sum(arm[i] for i in picked) / sum(baseline[i] for i in picked))
    ratios.sort()
    return sum(arm) / sum(baseline), ratios[int(draws * 0.025)], ratios[int(draws * 0.975) - 1]


def _quantile(values: list, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _bootstrap_quantile_ratio(values: list, baseline: list, q: float, draws: int = 4000) -> tuple:
    """The ratio of the ``q`` quantiles of two samples and its 95% bootstrap interval (seeded)."""
    import random

    generator = random.Random(0)
    ratios = sorted(_quantile(generator.choices(values, k=len(values)), q) /
                    _quantile(generator.choices(baseline, k=len(baseline)), q) for _ in range(draws))
    return _quantile(values, q) / _quantile(baseline, q), ratios[int(draws * 0.025)], ratios[int(draws * 0.975) - 1]


@contextlib.contextmanager
def _kernel_cells(args, timeout: float):
    """A fresh kernel with the package under test on its path; yields ``cell(code)``, which runs a cell and returns
    what it printed (a failed cell ends the benchmark with its traceback)."""
    from jupyter_client.manager import start_new_kernel
    from nbrun import run_cell

    path = [args.package or ROOT, os.path.join(ROOT, "tests")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        def cell(code: str, timeout: float = timeout) -> str:
            reply, told = run_cell(kc, code, timeout=timeout)
            if reply["status"] != "ok":
                raise SystemExit(told)
            return told

        yield cell
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _package_with_report_before(args, folder: str) -> str:
    """A copy of the package under test whose ``rank/metrics_before.py`` is ``rank/metrics.py`` of revision
    ``args.before_report``: a rank imports both, each with its own batches and sender thread's work."""
    import shutil
    import subprocess

    copy = os.path.join(folder, "package")
    shutil.copytree(os.path.join(args.package or ROOT, "ddp_notebook"), os.path.join(copy, "ddp_notebook"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    source = subprocess.run(["git", "show", f"{args.before_report}:ddp_notebook/rank/metrics.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    with open(os.path.join(copy, "ddp_notebook", "rank", "metrics_before.py"), "w") as handle:
        handle.write(source)
    return copy


def mlp_blocks_benchmark(args) -> None:
    """Part 5: report() against no call and against a no-op call, blocks of one job in shuffled rounds."""
    import tempfile

    with tempfile.TemporaryDirectory() as copies:
        if args.before_report:
            args.package = _package_with_report_before(args, copies)
        _mlp_blocks(args)


def _mlp_blocks(args) -> None:
    with _kernel_cells(args, 3600) as cell:
        cell("%load_ext ddp_notebook")
        if args.kernel_setup:
            cell(args.kernel_setup)
        kernel_pid = int(cell("import os; print(os.getpid())").split()[0])
        cell(MLP.format(kernel_pid=kernel_pid, steps=500, reporting=True))  # warm-up: imports, matplotlib
        started = time.time()
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "blocks")
            cell((MLP_LOADER_BLOCKS if args.loader else MLP_BLOCKS).format(
                kernel_pid=kernel_pid, rounds=args.rounds, block_steps=args.block_steps, out=out,
                before_arm=BEFORE_ARM if args.before_report else ""))
            rows = {}
            for rank in (0, 1):
                with open(f"{out}-{rank}.json") as handle:
                    rows[rank] = json.load(handle)
        took = time.time() - started
        zero = rows[0]
        wall = {arm: [b[0] for b in zero[arm]] for arm in zero}
        names = ({"plain": "torch's DataLoader", "noop": "distributed_loader",
                  "report": "distributed_loader and report() every step"} if args.loader else
                 {"plain": "no call", "noop": "no-op call (the design's noise, A/A)", "report": "report() every step"})
        print(f"## The MLP loop in one job: {args.rounds} rounds of three {args.block_steps:,}-step blocks "
              f"({', '.join(names.values())}), shuffled a round ({took:.0f} s)\n")
        print(f"block wall time, median: {names['plain']} {statistics.median(wall['plain']):.3f} s, {names['noop']} "
              f"{statistics.median(wall['noop']):.3f} s, {names['report']} {statistics.median(wall['report']):.3f} s "
              f"({args.block_steps / statistics.median(wall['plain']):,.0f} steps/s)\n")
        print(f"| ratio to the {names['plain']} blocks | summed: total time [95% bootstrap over rounds] | "
              "per round: mean [95% bootstrap interval] | median | range |")
        print("|---|---|---|---|---|")
        for arm, base, name in (("noop", "plain", names["noop"]), ("report", "plain", names["report"]),
                                ("report", "noop", f"{names['report']} against {names['noop']}")):
            ratios = [b / a for a, b in zip(wall[base], wall[arm])]
            mean, low, high = _bootstrap_mean(ratios)
            summed, summed_low, summed_high = _bootstrap_summed_ratio(wall[arm], wall[base])
            print(f"| {name} | **{summed:.4f}** [{summed_low:.4f}, {summed_high:.4f}] | {mean:.4f} [{low:.4f}, "
                  f"{high:.4f}] | {statistics.median(ratios):.4f} | {min(ratios):.3f}–{max(ratios):.3f} |")
        print("\nEach block's time is the loop's own plus what other processes took from it, which only adds: the "
              "lower quantiles of an arm's blocks are the least disturbed ones. Ratio to the no-call blocks' (95% "
              "bootstrap interval, blocks resampled within each arm):\n")
        print(f"| quantile of the blocks' times | {names['noop']} | {names['report']} |")
        print("|---|---|---|")
        for q in (0.1, 0.25, 0.5):
            cells = []
            for arm in ("noop", "report"):
                ratio, low, high = _bootstrap_quantile_ratio(wall[arm], wall["plain"], q)
                cells.append(f"{ratio:.4f} [{low:.4f}, {high:.4f}]")
            print(f"| {q:.2f} | {' | '.join(cells)} |")
        if args.raw:
            with open(args.raw, "w") as handle:
                json.dump({"block_steps": args.block_steps, "rounds": args.rounds, "blocks": rows}, handle)
            print(f"\n(every block's wall time and CPU: {args.raw})")
        total = {arm: sum(wall[arm]) for arm in wall}
        print(f"\nsummed over the rounds: {names['report']} {total['report'] / total['plain']:.4f}, {names['noop']} "
              f"{total['noop'] / total['plain']:.4f} of the {names['plain']} blocks' time")
        for rank in sorted(rows):
            cpu = {arm: sum(b[1] for b in rows[rank][arm]) for arm in rows[rank]}
            print(f"- rank {rank}'s CPU (all its threads): {names['report']} {cpu['report'] / cpu['plain']:.4f}, "
                  f"{names['noop']} {cpu['noop'] / cpu['plain']:.4f} of the {names['plain']} blocks'")
        kernel = {arm: sum(b[2] for b in zero[arm]) / sum(wall[arm]) for arm in zero}
        print(f"- kernel CPU during the blocks, % of a core: {names['report']} {kernel['report'] * 100:.2f}%, "
              f"{names['noop']} {kernel['noop'] * 100:.2f}%, {names['plain']} {kernel['plain'] * 100:.2f}%")
        front = {arm: sum(b[3] for b in zero[arm]) / sum(wall[arm]) for arm in zero}
        print(f"- the front end's CPU (this benchmark's Jupyter client, which receives the cell's output), % of a "
              f"core: {names['report']} {front['report'] * 100:.2f}%, {names['noop']} {front['noop'] * 100:.2f}%, "
              f"{names['plain']} {front['plain'] * 100:.2f}%")
        if "before" in zero:
            _before_rows(args, rows, wall)


def _before_rows(args, rows: dict, wall: dict) -> None:
    """The fourth arm's rows: the report() of ``args.before_report`` against no call and against today's."""
    before = f"report() of {args.before_report}"
    print(f"\n### {before}, a fourth arm in the same rounds\n")
    print("| summed ratio [95% bootstrap over rounds] | block wall time | rank 0's loop thread CPU | "
          "rank 1's loop thread CPU |")
    print("|---|---|---|---|")
    for arm, base, name in (("before", "plain", f"{before} / no call"), ("report", "plain", "report() / no call"),
                            ("report", "before", f"report() / {before}")):
        cells = [_bootstrap_summed_ratio(wall[arm], wall[base])]
        for rank in (0, 1):
            loop = {a: [b[4] for b in rows[rank][a]] for a in rows[rank]}
            cells.append(_bootstrap_summed_ratio(loop[arm], loop[base]))
        print(f"| {name} | " + " | ".join(f"{m:.4f} [{lo:.4f}, {hi:.4f}]" for m, lo, hi in cells) + " |")
    kernel = {arm: sum(b[2] for b in rows[0][arm]) / sum(wall[arm]) for arm in rows[0]}
    print(f"\nkernel CPU during the blocks, % of a core: report() {kernel['report'] * 100:.2f}%, {before} "
          f"{kernel['before'] * 100:.2f}%, no call {kernel['plain'] * 100:.2f}%")


# --frames: how live the figure stays.  Every figure the dashboard renders is noted in the kernel (when, whether drawn
# over the kept background, what it cost) while a job reports a falling loss every step of ~1 ms for 12 s.
FRAMES_SETUP = """\
import time
from ddp_notebook.notebook import dashboard
frames = []
_render = dashboard.Plot.render
def _noted_render(self, *args, **kwargs):
    before, started = self.blitted, time.thread_time()
    png = _render(self, *args, **kwargs)
    if png is not None and kwargs.get("title") is None:  # (a live frame: the final figure has a title)
        frames.append((time.monotonic(), self.blitted > before, time.thread_time() - started))
    return png
dashboard.Plot.render = _noted_render
"""
FRAMES_JOB = """\
%%ddp --cpus 2
import math, random, time
from ddp_notebook import report
for s in range({steps}):
    time.sleep(0.001)
    report(step=s, steps={steps}, loss={loss})
"""
FRAMES_FACTS = """\
import json
live = frames[:]
frames.clear()
gaps = [b[0] - a[0] for a, b in zip(live, live[1:])]
print("FRAMES", json.dumps({"frames": len(live), "whole": sum(1 for f in live if not f[1]),
                            "longest_gap_s": max(gaps, default=None), "cpu_s": sum(f[2] for f in live)}))
"""
LOSSES = {"falling to zero": "math.exp(-s / 1500)", "a long tail": "1 / (1 + s / 100)",
          "a noisy plateau": "2.3 + 0.3 * math.exp(-s / 3000) + 0.05 * random.random()"}


def frames_benchmark(args) -> None:
    """How many live frames a 12 s job reporting every step gets, and the longest wait between two."""
    steps = 12_000
    print(f"## Live frames of a {steps:,}-step job (1 ms a step, report() every step, 2 CPU ranks), "
          f"{args.rounds} runs of each loss\n")
    print("| loss | live frames, median (range) | drawn whole | longest wait between frames, median (range) | "
          "drawing CPU |")
    print("|---|---|---|---|---|")
    with _kernel_cells(args, 600) as cell:
        cell("%load_ext ddp_notebook")
        if args.kernel_setup:
            cell(args.kernel_setup)
        cell(FRAMES_SETUP)
        cell(FRAMES_JOB.format(steps=2_000, loss="1.0"))  # warm-up: the first figure imports matplotlib
        cell(FRAMES_FACTS)
        for name, loss in LOSSES.items():
            runs = []
            for _ in range(args.rounds):
                cell(FRAMES_JOB.format(steps=steps, loss=loss))
                told = cell(FRAMES_FACTS)
                runs.append(json.loads(told[told.index("FRAMES ") + len("FRAMES "):].splitlines()[0]))
            frames = [r["frames"] for r in runs]
            whole = [r["whole"] for r in runs]
            gaps = [r["longest_gap_s"] for r in runs if r["longest_gap_s"] is not None]
            cpu = [r["cpu_s"] for r in runs]
            print(f"| {name} | {statistics.median(frames):.0f} ({min(frames)}–{max(frames)}) | "
                  f"{statistics.median(whole):.0f} | {statistics.median(gaps):.1f} s ({min(gaps):.1f}–"
                  f"{max(gaps):.1f} s) | {statistics.median(cpu) * 1000:.0f} ms |")

KERNEL_FACTS = """\
import gc, json, ddp_notebook
gc.collect()
job = ddp_notebook.last_job()
print("FACTS", json.dumps({"records": len(job.history), "last": job.history[-1] if len(job.history) else None,
                           "history_bytes": job.history.__sizeof__()}))
"""


def _memory(pid: int) -> dict:
    """The process's PSS and RSS, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name in ("Pss", "Rss"):
                fields[name.lower()] = int(rest.split()[0]) * 1024
    return fields


def mlp_benchmark(args) -> None:
    """Part 4: the MLP loop with and without report() every step, in a real kernel; then a long run's memory."""
    with _kernel_cells(args, 1200) as cell:
        def printed(told: str, tag: str) -> dict:
            for line in told.splitlines():
                line = re.sub(r"^\[rank \d+\] ", "", line)
                if line.startswith(tag + " "):
                    return json.loads(line[len(tag) + 1:])
            raise SystemExit(f"no {tag} in {told[-2000:]}")

        cell("%load_ext ddp_notebook")
        if args.kernel_setup:
            cell(args.kernel_setup)
        kernel_pid = int(cell("import os, ddp_notebook; print(os.getpid(), ddp_notebook.__file__)").split()[0])
        print(f"kernel {kernel_pid}: ddp_notebook from {args.package or ROOT}\n")
        runs = {False: [], True: []}
        cell(MLP.format(kernel_pid=kernel_pid, steps=500, reporting=True))  # warm-up: imports, matplotlib
        for pair in range(args.mlp_pairs):
            for reporting in ((False, True, True, False) if pair % 2 == 0 else (True, False, False, True)):
                result = printed(cell(MLP.format(kernel_pid=kernel_pid, steps=args.mlp_steps,
                                                 reporting=reporting)), "RESULT")
                runs[reporting].append(result)
                print(f"  {'report' if reporting else 'plain '}: loop {result['loop_s']:.2f} s, "
                      f"kernel CPU {result['kernel_cpu_s']:.3f} s", flush=True)
        plain = statistics.median(r["loop_s"] for r in runs[False])
        reporting = statistics.median(r["loop_s"] for r in runs[True])
        ratios = [b["loop_s"] / a["loop_s"] for a, b in zip(runs[False], runs[True])]
        share = statistics.median(r["kernel_cpu_s"] / r["loop_s"] for r in runs[True])
        floor = statistics.median(r["kernel_cpu_s"] / r["loop_s"] for r in runs[False])
        print(f"\n## 2-layer MLP, DDP on 2 CPU ranks, {args.mlp_steps:,} steps a job, report() every step against "
              f"none\n")
        print("| | loop, median | kernel CPU during the loop (% of a core), median |")
        print("|---|---|---|")
        print(f"| without report() | {plain:.2f} s | {floor * 100:.2f}% |")
        print(f"| report() every step | {reporting:.2f} s | {share * 100:.2f}% |")
        print(f"\nloop time ratio: {reporting / plain:.3f} (medians); per alternated pair: "
              f"{', '.join(f'{r:.3f}' for r in ratios)}; {len(runs[True])} jobs each, "
              f"{args.mlp_steps / plain * 2:,.0f} reports/s over both ranks")

        if args.long_steps:
            cell("import gc; gc.collect()")
            before = _memory(kernel_pid)
            result = printed(cell(MLP.format(kernel_pid=kernel_pid, steps=args.long_steps, reporting=True),
                                  timeout=3600), "RESULT")
            facts = printed(cell(KERNEL_FACTS), "FACTS")
            after = _memory(kernel_pid)
            print(f"\n## One long run: {args.long_steps:,} steps reporting every step "
                  f"({result['loop_s']:.0f} s, kernel CPU {result['kernel_cpu_s'] / result['loop_s'] * 100:.2f}% "
                  f"of a core)\n")
            print(f"- kernel PSS {before['pss'] / 2**20:.1f} → {after['pss'] / 2**20:.1f} MiB "
                  f"(+{(after['pss'] - before['pss']) / 2**20:.1f} MiB), RSS {before['rss'] / 2**20:.1f} → "
                  f"{after['rss'] / 2**20:.1f} MiB (+{(after['rss'] - before['rss']) / 2**20:.1f} MiB)")
            print(f"- the history: {facts['records']:,} records, last {facts['last']}; "
                  f"its columns {facts['history_bytes'] / 2**20:.2f} MiB (History.__sizeof__; a list's is its "
                  f"pointers alone)")


def _results(cell, tag="RESULT"):
    """The JSON printed after ``tag`` in a cell, by the notebook or by a rank ("[rank N] " prefix)."""
    from nbrun import text

    found = []
    for line in text(cell).splitlines():
        line = re.sub(r"^\[rank \d+\] ", "", line)
        if line.startswith(tag + " "):
            found.append(json.loads(line[len(tag) + 1:]))
    return found


def _receive_all(conn) -> None:
    while True:
        try:
            conn.recv()
        except EOFError:
            return


def _loop_blocks(step, steps: int, pairs: int, reporting_fn) -> dict:
    """ABBA blocks of ``steps`` steps, with and without ``reporting_fn``: (wall, process CPU, thread CPU)."""
    blocks = {"plain": [], "report": []}
    x = 0
    for pair in range(pairs):
        for reporting in ((False, True, True, False) if pair % 2 == 0 else (True, False, False, True)):
            started, cpu, loop_cpu = time.perf_counter(), time.process_time(), time.thread_time()
            for _ in range(steps):
                loss = step()
                x += 1
                if reporting:
                    reporting_fn(step=x, loss=loss, acc=0.5)
            blocks["report" if reporting else "plain"].append(
                (time.perf_counter() - started, time.process_time() - cpu, time.thread_time() - loop_cpu))
    return blocks


def rank_side_alone(block_s: float, pairs: int) -> dict:
    """Part 2: this process plays one rank; its reports go to a process that only receives them."""
    import multiprocessing

    import torch

    from ddp_notebook import report
    from ddp_notebook.wire import channel
    from ddp_notebook.rank import context

    mine, theirs = multiprocessing.Pipe()
    sink = multiprocessing.get_context("spawn").Process(target=_receive_all, args=(theirs,), daemon=True)
    sink.start()
    theirs.close()
    sender = channel.Sender(mine)
    context.set_current(context.RankContext(rank=0, local_rank=0, world_size=1, local_world_size=1, sender=sender))
    torch.set_num_threads(1)
    a, b = torch.randn(64, 64), torch.randn(64, 64) / 8
    repeats = 1

    def step():
        c = a
        for _ in range(repeats):
            c = torch.tanh(c @ b)
        return float(c[0, 0])

    while True:
        started = time.perf_counter()
        for _ in range(200):
            step()
        if (time.perf_counter() - started) / 200 >= 1e-3:
            break
        repeats += 1
    steps = int(block_s / ((time.perf_counter() - started) / 200))
    try:
        return {"steps": steps, "blocks": _loop_blocks(step, steps, pairs, report)}
    finally:
        sender.flush()
        context.set_current(None)
        mine.close()
        sink.join(10)


def machine() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import psutil
    import torch

    return (f"{model}, {os.cpu_count()} logical CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM; "
            f"Linux {platform.release()}; Python {platform.python_version()}; torch {torch.__version__}")


def main() -> None:
    from nbrun import run_cells

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--block-s", type=float, default=2.0)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--mlp", action="store_true", help="part 4 alone: the MLP loop in a kernel, and memory")
    parser.add_argument("--mlp-steps", type=int, default=4000)
    parser.add_argument("--mlp-pairs", type=int, default=3)
    parser.add_argument("--mlp-blocks", action="store_true", help="part 5 alone: report() against no call and "
                        "a no-op call, blocks of one job in shuffled rounds")
    parser.add_argument("--loader", action="store_true", help="part 5 with loaders: torch's DataLoader against "
                        "distributed_loader, and distributed_loader with report() every step")
    parser.add_argument("--frames", action="store_true", help="how live the figure stays: frames of a job "
                        "reporting a falling loss every step (--rounds runs of each loss)")
    parser.add_argument("--block-steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--raw", help="part 5: write every block's figures to this JSON file")
    parser.add_argument("--long-steps", type=int, default=100_000, help="0: no long run")
    parser.add_argument("--kernel-setup", help="code run in the kernel after the extension loads (parts 4, 5 and "
                        "--frames): "
                        "settings to compare, e.g. 'from ddp_notebook.notebook import dashboard; "
                        "dashboard.DRAW_SHARE = 0'")
    parser.add_argument("--package", help="import ddp_notebook from this checkout in the kernel (part 4)")
    parser.add_argument("--before-report", metavar="REV",
                        help="part 5: a fourth arm, the report() of this git revision, beside today's in the same job")
    args = parser.parse_args()
    if args.before_report and (args.loader or not args.mlp_blocks):
        parser.error("--before-report is a fourth arm of --mlp-blocks without --loader")
    if args.frames:
        print(f"machine: {machine()}\n")
        frames_benchmark(args)
        return
    if args.mlp_blocks:
        print(f"machine: {machine()}\n")
        mlp_blocks_benchmark(args)
        return
    if args.mlp:
        print(f"machine: {machine()}\n")
        mlp_benchmark(args)
        return

    print(f"machine: {machine()}\n")
    cells = ["%load_ext ddp_notebook", PER_CALL]
    for ranks in args.ranks:
        cells.append(SLOWDOWN.format(ranks=ranks, block_s=args.block_s, pairs=args.pairs))
    started = time.time()
    nb, _ = run_cells(cells, timeout=600, cwd=ROOT)
    for cell in nb.cells:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        if errors:
            raise SystemExit("\n".join(errors[0].traceback))
    widget_view = "application/vnd.jupyter.widget-view+json"
    widget_outputs = sum(1 for o in nb.cells[2].outputs if widget_view in o.get("data", {}))

    per_call = _results(nb.cells[1])[0]
    print("## report() inside a rank\n")
    print(f"- report(step=i, loss=..., acc=...): {per_call['report_us']:.2f} µs per call, "
          f"{per_call['report_cpu_us']:.2f} µs of the calling thread's CPU ({per_call['calls']:,} calls in a loop)")
    print(f"- the sender thread had {per_call['drain_s']:.2f} s of queue left to send after the loop")
    print(f"- progress(i, n), throttled to ~10 events/s: {per_call['progress_us']:.2f} µs per call\n")

    alone = rank_side_alone(args.block_s, args.pairs)
    print("## The same loop, rank side alone (reports go to a process that only receives them)\n")
    for field, name in ((0, "wall time"), (2, "loop-thread CPU"), (1, "process CPU, sender thread included")):
        plain = statistics.median(b[field] for b in alone["blocks"]["plain"])
        reporting = statistics.median(b[field] for b in alone["blocks"]["report"])
        print(f"- {name}: {plain:.3f} s plain, {reporting:.3f} s reporting: {(reporting / plain - 1) * 100:+.2f}%")
    print(f"  ({alone['steps']} steps a block)\n")

    print("## Training loop of ~1 ms steps reporting every step (1,000 reports/s per rank), dashboard drawing\n")
    print("Medians over blocks; overheads relative to the same blocks without report().\n")
    print("| ranks | steps/block | plain block | reporting block | wall-time slowdown (per rank) | "
          "loop-thread CPU overhead | rank CPU overhead, sender included | notebook CPU per report |")
    print("|---|---|---|---|---|---|---|---|")
    for index, ranks in enumerate(args.ranks):
        rows = sorted(_results(nb.cells[2 + index]), key=lambda r: r["rank"])

        def overhead(row, field):
            plain = statistics.median(b[field] for b in row["blocks"]["plain"])
            return statistics.median(b[field] for b in row["blocks"]["report"]) / plain - 1

        wall = [overhead(r, 0) for r in rows]
        cpu = [overhead(r, 1) for r in rows]
        loop = [overhead(r, 3) for r in rows]
        plain_s = statistics.median(b[0] for r in rows for b in r["blocks"]["plain"])
        report_s = statistics.median(b[0] for r in rows for b in r["blocks"]["report"])
        reports_per_block = rows[0]["steps"] * len(rows)
        kernel_us = (statistics.median(b[2] for b in rows[0]["blocks"]["report"]) -
                     statistics.median(b[2] for b in rows[0]["blocks"]["plain"])) / reports_per_block * 1e6
        print(f"| {ranks} | {rows[0]['steps']} | {plain_s:.3f} s | {report_s:.3f} s | "
              f"{statistics.mean(wall) * 100:+.2f}% ({', '.join(f'{w * 100:+.2f}%' for w in wall)}) | "
              f"{statistics.mean(loop) * 100:+.2f}% ({', '.join(f'{c * 100:+.2f}%' for c in loop)}) | "
              f"{statistics.mean(cpu) * 100:+.2f}% ({', '.join(f'{c * 100:+.2f}%' for c in cpu)}) | "
              f"{kernel_us:.1f} µs |")
    print(f"\n(dashboard shown as widgets: {bool(widget_outputs)}; whole benchmark {time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
