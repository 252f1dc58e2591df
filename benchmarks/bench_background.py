"""Background jobs in a long session (issue 35): the kernel's memory and descriptors, written to
benchmarks/RESULTS_background.md.

    python benchmarks/bench_background.py [--jobs 60] [--repeats 2] [--before PATH]

A fresh kernel per round, a warm pool of 2 CPU ranks, 8 background jobs of warm-up; then ``--jobs`` background jobs,
half ``%%ddp --background`` cells that report (each draws its dashboard) and half ``launch(..., background=True)``
on ranks of their own, each waited for.  From outside the kernel (psutil): its PSS growth over the jobs, and how many
descriptors more it holds right after each job's end (the garbage collector left on, as a user has it).  Also the
cost of giving the heap's free pages back once a job has ended (``engine.job.trim_heap``, timed in the kernel).

``--before PATH``: a folder holding an older ``ddp_notebook`` (e.g. ``git archive BASE ddp_notebook | tar -x -C
PATH``), measured in alternate rounds.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import psutil
from jupyter_client.manager import start_new_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WARM_UP = 8
SETUP = """
%load_ext ddp_notebook
import os, time, ddp_notebook
def reports(steps=1):
    for step in range(steps):
        ddp_notebook.report(step=step, steps=steps, loss=1.0 / (step + 1))
    return steps
%ddp_start --cpus 2
"""
CELL = "%%ddp --background --return x\nx = reports()"
LAUNCH = "job = ddp_notebook.launch(reports, cpus=2, background=True)"
WAIT = "print(ddp_notebook.last_job().join(timeout=60))"
TRIM = """
from ddp_notebook.engine.job import trim_heap
started = time.perf_counter()
for _ in range(20):
    trim_heap()
print((time.perf_counter() - started) / 20)
"""


def _run(kc, code: str) -> str:
    said = []

    def collect(msg):
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            said.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(code, timeout=120, output_hook=collect)
    if reply["content"]["status"] != "ok":
        raise RuntimeError("".join(said))
    return "".join(said)


def one_round(jobs: int, path: str) -> dict:
    """PSS growth (bytes) every 10 jobs, the most descriptors more than at the start right after a job's end, and
    the heap trim's cost (seconds; None where the package has none) in a fresh kernel importing ``path``."""
    env = dict(os.environ, PYTHONPATH=path)
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        process = psutil.Process(int(_run(kc, "import os\nprint(os.getpid())")))
        _run(kc, SETUP)
        for i in range(WARM_UP):
            _run(kc, CELL if i % 2 == 0 else LAUNCH)
            _run(kc, WAIT)
        _run(kc, "import gc\ngc.collect()")
        time.sleep(11)  # (ipykernel's own clean-up of ended threads' sockets runs every 10 s)
        pss0, fds0 = process.memory_full_info().pss, process.num_fds()
        growth, extra_fds = [], []
        for i in range(jobs):
            _run(kc, CELL if i % 2 == 0 else LAUNCH)
            _run(kc, WAIT)
            extra_fds.append(process.num_fds() - fds0)
            if (i + 1) % 10 == 0:
                growth.append(process.memory_full_info().pss - pss0)
        try:
            trim = float(_run(kc, TRIM))
        except RuntimeError:
            trim = None
        _run(kc, "%ddp_stop")
        return {"growth": growth, "max_extra_fds": max(extra_fds), "last_extra_fds": extra_fds[-1], "trim": trim}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before", help="a folder holding an older ddp_notebook, measured alongside")
    args = parser.parse_args()
    contenders = {"now": ROOT}
    if args.before:
        contenders["before"] = os.path.abspath(args.before)
    load = os.getloadavg()[0]
    rounds: dict[str, list[dict]] = {name: [] for name in contenders}
    names = list(contenders)
    for rep in range(args.repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            rounds[name].append(one_round(args.jobs, contenders[name]))
            print(name, rounds[name][-1], flush=True)
    mib = 2 ** 20
    lines = ["# Background jobs in a long session: the kernel's memory and descriptors", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores (load average {load:.1f} at the start), Python "
             f"{platform.python_version()}. A fresh kernel per round, a warm pool of 2 CPU ranks, {WARM_UP} "
             f"background jobs of warm-up, then {args.jobs}: `%%ddp --background` cells that report (each draws its "
             f"dashboard) alternating with `launch(..., background=True)` on ranks of their own, each waited for "
             f"(`join()`). PSS and descriptors of the kernel read from outside (psutil), the garbage collector on; "
             f"{args.repeats} rounds per contender, alternating. `python benchmarks/bench_background.py --jobs "
             f"{args.jobs} --repeats {args.repeats}{' --before PATH' if args.before else ''}`.", "",
             "| contender | PSS growth after 10, 20, ... jobs (MiB, each round) | descriptors more right after a "
             "job's end (most; after the last) | heap trim |", "|---|---|---|---|"]
    for name, results in rounds.items():
        growth = "; ".join(", ".join(f"{g / mib:.1f}" for g in r["growth"]) for r in results)
        fds = "; ".join(f"{r['max_extra_fds']}; {r['last_extra_fds']}" for r in results)
        trims = [r["trim"] for r in results if r["trim"] is not None]
        trim = f"{statistics.median(trims) * 1e3:.2f} ms" if trims else "—"
        lines.append(f"| {name} | {growth} | {fds} | {trim} |")
    lines.append("")
    for name, results in rounds.items():
        final = statistics.median(r["growth"][-1] for r in results) / mib
        lines.append(f"- {name}: {final:.1f} MiB after {args.jobs} jobs (median of the rounds), "
                     f"{final * 1024 / args.jobs:.0f} KiB a job")
    out = os.path.join(HERE, "RESULTS_background.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
