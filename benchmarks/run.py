#!/usr/bin/env python
"""Rerun every benchmark and write benchmarks/RESULTS.md.

    python benchmarks/run.py                 # the default run: about 16 minutes on 2 cores
    python benchmarks/run.py --repeats 15    # more repeats (or DDP_NOTEBOOK_BENCH_REPEATS=15)
    python benchmarks/run.py --smoke --out /tmp/r.md   # seconds-scale check that it all still runs

Contenders are run alternately (the order rotates every repeat), so slow drift of
the machine's load hits all of them alike; every ratio comes from this one run.
This script never imports torch: every contender runs in processes of its own.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOADS = os.path.join(HERE, "workloads.py")
PY = sys.executable
GIB = 1 << 30


def _torchrun() -> list[str]:
    script = os.path.join(os.path.dirname(PY), "torchrun")
    return [script] if os.path.exists(script) else [PY, "-m", "torch.distributed.run"]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    ram = None
    try:
        with open("/proc/meminfo") as f:
            ram = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "ram_gib": ram / GIB if ram else None,
            "python": platform.python_version(), "torch": _version("torch"), "numpy": _version("numpy"),
            "cloudpickle": _version("cloudpickle"), "accelerate": _version("accelerate"),
            "kernel": platform.release(), "load_start": os.getloadavg()}


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "runs": values}


# -- contenders of the cold-launch benchmark ----------------------------------------------------------------


class Process:
    """A fresh process per run: its whole wall time counts."""

    def __init__(self, name: str, command, tmp: str):
        self.name, self.command, self.tmp = name, command, tmp

    def start(self) -> None:
        pass

    def once(self) -> float:
        command = self.command() if callable(self.command) else self.command
        started = time.perf_counter()
        subprocess.run(command, env=_env(TMPDIR=self.tmp), cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        return time.perf_counter() - started

    def stop(self) -> None:
        pass


class Caller:
    """A live process, like a notebook kernel with the launcher imported; each run is one call there."""

    def __init__(self, name: str, kind: str, tmp: str):
        self.name, self.kind, self.tmp, self.proc = name, kind, tmp, None

    def start(self) -> None:
        self.proc = subprocess.Popen([PY, WORKLOADS, "caller", self.kind], env=_env(TMPDIR=self.tmp), cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{self.name}: the caller did not start")

    def once(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: the caller died")
            if line.startswith("took "):
                return float(line.split()[1])

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def bench_launch(reps: int, work: str) -> dict:
    tmp = {}

    def private(name):
        tmp[name] = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
        return tmp[name]

    contenders = [
        Process("python -c 'import torch'", [PY, "-c", "import torch"], private("import")),
        Caller("launch() from a live process", "launch", private("launch")),
        Caller("launch() from a live process, template cold", "launch-template-cold", private("launch_cold")),
        Caller("launch() from a live process, no template", "launch-no-template", private("launch_fresh_ranks")),
        Process("launch() in a fresh python", [PY, WORKLOADS, "launch-once"], private("launch_fresh")),
        Process("torchrun --nproc-per-node 2",
                lambda: _torchrun() + ["--nproc-per-node", "2", "--master-port", str(_free_port()), WORKLOADS,
                                       "torchrun-trivial"], private("torchrun")),
        Process("mp.spawn from a file", [PY, WORKLOADS, "spawn-trivial"], private("spawn")),
    ]
    notes = []
    if _version("accelerate"):
        contenders.append(Caller("accelerate notebook_launcher from a live process", "accelerate",
                                 private("accelerate")))
        contenders.append(Process("accelerate notebook_launcher in a fresh python", [PY, WORKLOADS,
                                                                                      "accelerate-trivial"],
                                  private("accelerate_fresh")))
    else:
        notes.append("accelerate is not installed here: its notebook_launcher was not measured")
    if _version("lightning"):
        contenders.append(Caller("Lightning ddp_notebook (fork) from a live process", "lightning",
                                 private("lightning")))
    else:
        notes.append("lightning is not installed here: its ddp_notebook launcher was not measured")
    times = {c.name: [] for c in contenders}
    for c in contenders:
        c.start()
    try:
        for c in contenders:  # one unrecorded run each: page cache and .pyc warm for everyone
            c.once()
        for rep in range(reps):
            k = rep % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                times[c.name].append(c.once())
    finally:
        for c in contenders:
            c.stop()
    leftovers = {}
    for c in contenders:
        left = os.listdir(c.tmp)
        if left:
            leftovers[c.name] = len(left)
    return {"times": {name: _summary(v) for name, v in times.items()}, "leftovers": leftovers, "notes": notes,
            "raw": times}


def _paired(raw: dict, a: str, b: str) -> float:
    """Median of the per-repeat ratios a/b: runs of one repeat are close in time, so load drift cancels."""
    return statistics.median(x / y for x, y in zip(raw[a], raw[b]))


def bench_throughput(reps: int, steps: int, work: str) -> dict:
    results = {"launch()": [], "torchrun": []}
    out = os.path.join(work, "cnn.json")
    for rep in range(reps):
        order = ["launch()", "torchrun"] if rep % 2 == 0 else ["torchrun", "launch()"]
        for name in order:
            args = [out, str(steps), "10", "64"]
            for attempt in (1, 2):  # a free port found for torchrun can be taken before it binds it: try again
                if name == "launch()":
                    command = [PY, WORKLOADS, "launch-cnn"] + args
                else:
                    command = _torchrun() + ["--nproc-per-node", "2", "--master-port", str(_free_port()), WORKLOADS,
                                             "torchrun-cnn"] + args
                done = subprocess.run(command, env=_env(OMP_NUM_THREADS=1, TMPDIR=work), cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                if done.returncode == 0:
                    break
                print(f"{name} failed (attempt {attempt}):\n{done.stderr[-3000:]}", file=sys.stderr)
            done.check_returncode()
            with open(out) as f:
                found = json.load(f)
            results[name].append(found["samples_per_s"])
            results.setdefault("threads", {})[name] = (found["threads"], found["omp"])
    threads = results.pop("threads")
    return {"rates": {k: _summary(v) for k, v in results.items()}, "threads": threads,
            "paired": statistics.median(a / b for a, b in zip(results["launch()"], results["torchrun"]))}


def bench_memory(reps: int, nbytes: int, work: str, shape: str = "large", smoke: bool = False) -> dict:
    """``smoke``: one run of fewer modes, no separate timing runs."""
    modes = ["shared-ext", "shared", "naive", "fork"] if shape == "large" else ["shared-ext", "shared", "fork"]
    if smoke:  # the others differ from these by a flag or an environment variable only
        modes = ["shared-ext", "fork"]
    peaks = {m: [] for m in modes}
    first = {m: [] for m in modes}
    intervals = []
    parts = {}
    for rep in range(reps):
        k = rep % len(modes)
        for mode in modes[k:] + modes[:k]:
            out, sampled = os.path.join(work, f"mem-{mode}.json"), os.path.join(work, f"pss-{mode}.json")
            # Twice: with the sampler for the peak, without it for the time to the first batch (on a
            # small machine the sampler's reads of smaps_rollup take CPU from the ranks).
            # Three timing runs (one of the slow plain-cloudpickle one): a single start-up is noisy.
            timed = 0 if smoke else 1 if mode == "naive" or shape == "small" else 3
            for sampling in (True,) + (False,) * timed:
                notebook = subprocess.Popen([PY, WORKLOADS, "memory", mode, str(nbytes), out, shape],
                                            env=_env(TMPDIR=work), cwd=ROOT, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL)
                sampler = None
                if sampling:
                    sampler = subprocess.Popen([PY, os.path.join(HERE, "pss_sampler.py"), str(notebook.pid),
                                                sampled], cwd=ROOT)
                if notebook.wait() != 0:
                    raise RuntimeError(f"the {mode} memory run failed")
                if sampler is not None:
                    sampler.wait(timeout=60)
                    with open(sampled) as f:
                        pss = json.load(f)
                    peaks[mode].append(pss["peak_bytes"] / GIB)
                    parts[mode] = pss["peak_processes"]
                    intervals.append(pss["mean_interval_s"])
                if not sampling or not timed:
                    with open(out) as f:
                        timing = json.load(f)
                    first[mode].append(timing["first_batch"] - timing["called"])
    return {"peak_gib": {m: _summary(v) for m, v in peaks.items()},
            "first_batch_s": {m: _summary(v) for m, v in first.items()},
            "mean_interval_ms": 1000 * statistics.mean(intervals), "at_peak": parts,
            "timed_apart": not smoke}


def bench_dump_load(nbytes: int, work: str) -> dict:
    out = os.path.join(work, "dumpload.json")
    subprocess.run([PY, WORKLOADS, "dump-load", str(nbytes), out], env=_env(TMPDIR=work), cwd=ROOT, check=True)
    with open(out) as f:
        return json.load(f)


def bench_report(work: str) -> dict:
    out = os.path.join(work, "report.json")
    subprocess.run([PY, WORKLOADS, "launch-report", out], env=_env(TMPDIR=work), cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        return {"us_per_call": json.load(f)}


# -- the report --------------------------------------------------------------------------------------------


def _s(x: float) -> str:
    return f"{x:.2f}"


def _row(name: str, s: dict, fmt=_s) -> str:
    return f"| {name} | {fmt(s['median'])} | {fmt(s['min'])}–{fmt(s['max'])} | {s['n']} |"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def write_report(path: str, r: dict, args) -> None:
    m = r["machine"]
    lines = [
        "# Benchmarks", "",
        f"Written by `python benchmarks/run.py{' --smoke' if args.smoke else ''}"
        f"{' --repeats ' + str(args.repeats) if args.repeats != DEFAULT_REPEATS else ''}` on "
        f"{time.strftime('%Y-%m-%d %H:%M')}; {r['elapsed_s']:.0f} s in all. Medians, min–max and the number of "
        f"runs; contenders alternate (the order rotates each repeat), every ratio is from this run.", "",
        "## Machine", "",
        f"- CPU: {m['cpu']}, {m['cores']} cores usable; RAM {m['ram_gib']:.1f} GiB; Linux {m['kernel']}",
        f"- Python {m['python']}, torch {m['torch']}, numpy {m['numpy']}, cloudpickle {m['cloudpickle']}, "
        f"accelerate {m['accelerate'] or 'not installed'}",
        f"- load average at start {m['load_start'][0]:.2f}, at end {r['load_end'][0]:.2f} (other work on the "
        f"machine slows every contender alike, not the ratios)", "",
    ]
    if "launch" in r:
        t = r["launch"]["times"]
        lines += ["## Cold launch of a trivial 2-rank job (init, one all_reduce, exit)", "",
                  "Wall time, seconds. *Live process*: called from a running Python process that imported its "
                  "launcher already, as a notebook kernel does; *fresh*: the whole command, interpreter start "
                  "included. launch() from a live process forks its ranks from the rank template, warm "
                  "between calls as in a kernel; *template cold*: the template is stopped before each call, "
                  "which then starts one and waits for it; *no template*: `DDP_NOTEBOOK_TEMPLATE=0`, every "
                  "rank a fresh interpreter.", "",
                  "| contender | median | min–max | runs |", "| --- | --- | --- | --- |"]
        lines += [_row(name, s) for name, s in t.items()]
        raw = r["launch"]["raw"]
        live, imp, tr = "launch() from a live process", "python -c 'import torch'", "torchrun --nproc-per-node 2"

        def ratio_row(label, a, b, target=None):
            medians, paired = t[a]["median"] / t[b]["median"], _paired(raw, a, b)
            verdict = ""
            if target is not None:
                verdict = f"≤ {target}: {_verdict(medians <= target)} (paired: {_verdict(paired <= target)})"
            return f"| {label} | {medians:.2f} | {paired:.2f} | {verdict} |"

        lines += ["", "| ratio | of medians | paired (median of per-repeat ratios) | target |",
                  "| --- | --- | --- | --- |",
                  ratio_row("launch() / torchrun", live, tr, 0.15),
                  ratio_row("launch(), template cold / torchrun", "launch() from a live process, template cold", tr),
                  ratio_row("launch(), no template / torchrun", "launch() from a live process, no template", tr),
                  ratio_row("launch() / `python -c 'import torch'`", live, imp, 1.1),
                  ratio_row("launch() in a fresh python / torchrun", "launch() in a fresh python", tr),
                  ratio_row("mp.spawn from a file / torchrun", "mp.spawn from a file", tr)]
        if "accelerate notebook_launcher from a live process" in t:
            lines.append(ratio_row("launch() / accelerate notebook_launcher, both from a live process", live,
                                   "accelerate notebook_launcher from a live process", 2))
        if "Lightning ddp_notebook (fork) from a live process" in t:
            lines.append(ratio_row("launch() / Lightning ddp_notebook, both from a live process", live,
                                   "Lightning ddp_notebook (fork) from a live process"))
        lines.append("")
        for note in r["launch"]["notes"]:
            lines.append(f"- {note}")
        if r["launch"]["leftovers"]:
            lines.append("- left behind in the contender's private temp directory: " + ", ".join(
                f"{name}: {n} entries" for name, n in r["launch"]["leftovers"].items()))
        else:
            lines.append("- no contender left anything in its private temp directory")
        lines.append("")
    if "throughput" in r:
        rates = r["throughput"]["rates"]
        ratio = rates["launch()"]["median"] / rates["torchrun"]["median"]
        lines += ["## Steady-state training throughput, small CNN on synthetic data", "",
                  f"Samples per second over 2 ranks (batch 64 per rank, 32×32×3 images, 2 conv layers + linear, "
                  f"DDP over gloo, {r['throughput']['steps']} steps timed inside the ranks after 10 warm-up steps), "
                  f"the same loop under both; OMP_NUM_THREADS=1 per rank on both sides "
                  f"(threads seen in the ranks: {r['throughput']['threads']}).", "",
                  "| launcher | median | min–max | runs |", "| --- | --- | --- | --- |",
                  _row("launch()", rates["launch()"], lambda x: f"{x:.0f}"),
                  _row("torchrun", rates["torchrun"], lambda x: f"{x:.0f}"), "",
                  f"launch() / torchrun = {ratio:.3f} of medians, {r['throughput']['paired']:.3f} paired (median "
                  f"of per-repeat ratios); target ≥ 0.98: {_verdict(ratio >= 0.98)} "
                  f"(paired: {_verdict(r['throughput']['paired'] >= 0.98)}). "
                  f"No GPU was available to this run, so there is no NCCL row.", ""]
    shapes = {"memory": "87 k samples of 32×32×3 (a DistributedSampler, batch 512)",
              "memory_small": "4.2 M samples of 63 features and a target (`distributed_loader`, batch 65,536)"}
    for key, shape in shapes.items():
        if key not in r:
            continue
        mem = r[key]
        size = r["memory_bytes"] / GIB
        lines += [f"## Memory: a {size:.2f} GiB TensorDataset, {shape}, 2 ranks, 2 epochs", "",
                  f"Peak total PSS (GiB) of the notebook process and all its descendants (the rank template "
                  f"included), read from /proc/PID/smaps_rollup by a separate sampler every 20 ms (mean interval "
                  f"{mem['mean_interval_ms']:.0f} ms). The notebook (a fresh process) imports torch, makes the dataset, "
                  f"then trains: one launch(), or fork. *After `%load_ext`*: it first does what `%load_ext "
                  f"ddp_notebook` does, start the rank template in the background, as a notebook's first cell "
                  f"would; without it the launch() call starts the template and waits for it. Big tensors reach "
                  f"the ranks through shared memory in both. The peak covers all of it.", "",
                  "| how the ranks get the dataset | peak PSS | min–max | runs | launch to first batch (s)"
                  + (", median of runs without the sampler (3; 1 for plain cloudpickle) |" if mem["timed_apart"]
                     else " |"),
                  "| --- | --- | --- | --- | --- |"]
        names = {"shared-ext": "launch() after `%load_ext ddp_notebook` (the template warm by then)",
                 "shared": "launch() with no extension loaded (the template starts with the call)",
                 "naive": "launch(), sharing off (plain cloudpickle)",
                 "fork": "fork (torch.multiprocessing, start method fork)"}
        names = {mode: label for mode, label in names.items() if mode in mem["peak_gib"]}
        for mode, label in names.items():
            p, f = mem["peak_gib"][mode], mem["first_batch_s"][mode]
            lines.append(f"| {label} | {p['median']:.2f} | {p['min']:.2f}–{p['max']:.2f} | {p['n']} | "
                         f"{f['median']:.2f} |")
        lines += ["", "At the peak of the last run of each (MiB of PSS: anonymous / file / shmem; the notebook "
                      "process first):", ""]
        for mode, label in names.items():
            procs = mem["at_peak"][mode]
            lines.append(f"- {label}: " + "; ".join(
                f"{p['pss']:.0f} ({p.get('anon', 0):.0f} / {p.get('file', 0):.0f} / {p.get('shmem', 0):.0f})"
                for p in procs))
        fork, first_fork = mem["peak_gib"]["fork"]["median"], mem["first_batch_s"]["fork"]["median"]
        lines.append("")
        for mode in [m for m in ("shared-ext", "shared") if m in mem["peak_gib"]]:
            peak, first = mem["peak_gib"][mode]["median"], mem["first_batch_s"][mode]["median"]
            lines += [f"- {names[mode]}: peak {peak:.2f} GiB, {peak / fork:.2f}× fork's; target ≤ 1.5 GiB: "
                      f"{_verdict(peak <= 1.5)}. Launch to first batch {first:.2f} s against fork's "
                      f"{first_fork:.2f} s, {first / first_fork:.2f}×; target ≤ 1.5×: "
                      f"{_verdict(first <= 1.5 * first_fork)}"]
        lines.append("")
    if "dump_load" in r:
        lines += [f"## Dump and load of the {r['memory_bytes'] / GIB:.2f} GiB TensorDataset", "",
                  "Dump: `payload.dumps` in the notebook (a first move into shared memory goes on in a thread "
                  "while the ranks start: *moved* is when it is done). Load: `payload.load` in a fresh process "
                  "that has imported torch; then one full pass over the data (every page read once).", "",
                  "| payload | dump (s) | moved (s) | payload file | load (s) | load + full pass (s) |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for label, d in r["dump_load"].items():
            lines.append(f"| {label} | {d['dump_s']:.3f} | {d.get('settled_s', d['dump_s']):.3f} | "
                         f"{d['payload_bytes'] / 1e6:.2f} MB | {d['load_s']:.3f} | {d['load_and_read_s']:.3f} |")
        lines.append("")
    if "report" in r:
        per_rank = ", ".join(f"{x:.1f}" for x in r["report"]["us_per_call"])
        lines += ["## report()", "", f"Per call inside a rank of a running job (5000 calls): {per_rank} µs "
                  f"(rank 0, rank 1).", ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


DEFAULT_REPEATS = 7


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int,
                        default=int(os.environ.get("DDP_NOTEBOOK_BENCH_REPEATS", DEFAULT_REPEATS)),
                        help="runs of each launch contender (throughput and memory scale with it)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and one run each: checks it all runs")
    parser.add_argument("--only", default="launch,throughput,memory,memory_small,dump_load,report",
                        help="comma-separated sections")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    args = parser.parse_args()
    sections = set(args.only.split(","))
    reps = 1 if args.smoke else args.repeats
    nbytes = (64 << 20) if args.smoke else GIB
    steps = 10 if args.smoke else 200
    started = time.perf_counter()
    r = {"machine": machine(), "memory_bytes": nbytes}
    work = tempfile.mkdtemp(prefix="ddp_notebook-bench-")
    try:
        if "launch" in sections:
            print("cold launch ...", file=sys.stderr)
            r["launch"] = bench_launch(reps, work)
        if "throughput" in sections:
            print("throughput ...", file=sys.stderr)
            r["throughput"] = bench_throughput(1 if args.smoke else max(12, reps), steps, work)  # 1-2% noise per run
            r["throughput"]["steps"] = steps
        if "memory" in sections:
            print("memory ...", file=sys.stderr)
            r["memory"] = bench_memory(max(1, reps // 5), nbytes, work, smoke=args.smoke)
        if "memory_small" in sections:
            print("memory, small samples ...", file=sys.stderr)
            r["memory_small"] = bench_memory(max(1, reps // 5), nbytes, work, shape="small", smoke=args.smoke)
        if "dump_load" in sections:
            print("dump and load ...", file=sys.stderr)
            r["dump_load"] = bench_dump_load(nbytes, work)
        if "report" in sections:
            print("report() ...", file=sys.stderr)
            r["report"] = bench_report(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r["load_end"] = os.getloadavg()
    r["elapsed_s"] = time.perf_counter() - started
    write_report(args.out, r, args)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(r, f, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
