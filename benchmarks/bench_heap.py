"""The rank template's and ranks' imports and the garbage collector (``rank/heap.py``), written to
benchmarks/RESULTS_heap.md.

    python benchmarks/bench_heap.py --before PATH [--repeats 6] [--out FILE]

Two conditions, one table each: a quiet machine, then a busy one (one CPU-bound process beside, started for the
rounds and stopped after).

Each round runs, in a fresh python for each of "now" and "before" (``PATH``: a folder holding an older
``ddp_notebook``, e.g. ``git worktree add PATH BASE``), the order alternating: two ``launch()`` calls of a 2-rank
DDP job that builds a small DDP model, runs a step and then a full collection (``gc.collect()``, as Python makes by
itself once enough objects have survived), and reads its own PSS.  Measured: the CPU of the template and the ranks
(the script's children, all reaped), the first call's time (it starts the template), a rank's full collection, and
its PSS after it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ONE_RUN = r"""
import json, resource, time
import ddp_notebook
from ddp_notebook.engine import template

def job():
    import gc, time
    import psutil, torch
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started, psutil.Process().memory_full_info().pss / 2**20

started = time.perf_counter()
ddp_notebook.launch(job, cpus=2)
first = time.perf_counter() - started
second = ddp_notebook.launch(job, cpus=2)
template.stop()
time.sleep(0.5)
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"cpu_s": children.ru_utime + children.ru_stime, "first_s": first,
                  "collect_ms": [1000 * r[0] for r in second], "pss_mib": [r[1] for r in second]}))
"""


def once(path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run([sys.executable, "-c", ONE_RUN], capture_output=True, text=True, env=env, timeout=300,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _median(values) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="a folder holding an older ddp_notebook")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", default="RESULTS_heap.md", help="the file under benchmarks/ to write")
    args = parser.parse_args()
    arms = {"now": ROOT, "before": os.path.abspath(args.before)}
    once(ROOT)  # (unrecorded: the page cache)
    lines = ["# The rank template's imports and the garbage collector", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
             f"`python benchmarks/bench_heap.py --before PATH --repeats {args.repeats}`: {args.repeats} rounds a "
             "condition, each a fresh python per arm, the order alternating; medians (min–max). A round: two "
             "`launch()` calls of a 2-rank job that builds a DDP model, runs a step, then `gc.collect()` and reads "
             "its PSS."]
    for condition in ("quiet", "busy"):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if condition == "busy" else None
        try:
            runs: dict[str, list[dict]] = {arm: [] for arm in arms}
            for round_ in range(args.repeats):
                for arm in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                    runs[arm].append(once(arms[arm]))
                    print(condition, arm, runs[arm][-1], flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        lines += ["", f"## {'A quiet machine' if busy is None else 'A busy machine: one CPU-bound process beside'}",
                  "", "| | now | before | now / before |", "|---|---|---|---|"]
        rows = (("template and ranks, CPU-s (the script's children)", lambda r: [r["cpu_s"]]),
                ("first `launch()` (starts the template), s", lambda r: [r["first_s"]]),
                ("a rank's full collection, ms", lambda r: r["collect_ms"]),
                ("a rank's PSS after it, MiB", lambda r: r["pss_mib"]))
        for label, read in rows:
            now = [v for r in runs["now"] for v in read(r)]
            before = [v for r in runs["before"] for v in read(r)]
            lines.append(f"| {label} | {_median(now)} | {_median(before)} | "
                         f"{statistics.median(now) / statistics.median(before):.2g}× |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(HERE, args.out), "w") as handle:
        handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
