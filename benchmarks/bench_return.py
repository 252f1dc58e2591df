"""The notebook's peak memory growth while a 2-rank job returns a 320 MiB model, results by shared memory against
results pickled in the message (``DDP_NOTEBOOK_SHARE_MIN_BYTES=off``: how every result came back before), the
contenders alternating.

``python benchmarks/bench_return.py [--repeats N] [--mib M]`` writes ``RESULTS_return.md``.  The notebook is a
process of its own (it never starts the sampler); its PSS is read from /proc/PID/smaps_rollup every 20 ms by this
driver, from the moment it has warmed up (a first job run, its template started) until the model is in its hands and
every page of it has been read.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pss_sampler import INTERVAL_S, rollup  # noqa: E402

NOTEBOOK = r"""
import sys, torch, ddp_notebook

def nothing():
    return None

def model_of(mib):
    import torch
    from ddp_notebook.rank import context

    width = 4096
    layers = max(1, mib * 2**20 // (4 * width * width))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    return model if context.current().rank == 0 else None  # (as --return: rank 0's)

mib = int(sys.argv[1])
ddp_notebook.launch(nothing, cpus=2)  # the rank template started, every import done
print("ready", flush=True)
sys.stdin.readline()
model = ddp_notebook.launch(model_of, (mib,), cpus=2)[0]
size = sum(p.numel() * p.element_size() for p in model.parameters())
checksum = sum(float(p.sum()) for p in model.parameters())  # every page read: mapped pages count once touched
print("done", size, flush=True)
sys.stdin.readline()
"""


def one_run(share: bool, mib: int) -> tuple[int, int]:
    """(peak PSS growth of the notebook process, the model's bytes)."""
    env = dict(os.environ)
    if not share:
        env["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = "off"
    proc = subprocess.Popen([sys.executable, "-c", NOTEBOOK, str(mib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        base = rollup(proc.pid)["pss"]
        peak = [base]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                found = rollup(proc.pid)
                if found is not None:
                    peak[0] = max(peak[0], found["pss"])
                time.sleep(INTERVAL_S)

        sampler = threading.Thread(target=sample)
        sampler.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        words = proc.stdout.readline().split()
        stop.set()
        sampler.join()
        assert words[0] == "done", words
        peak[0] = max(peak[0], rollup(proc.pid)["pss"])
        return peak[0] - base, int(words[1])
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mib", type=int, default=320)
    args = parser.parse_args()
    runs: dict[str, list[float]] = {"shared memory": [], "pickled (DDP_NOTEBOOK_SHARE_MIN_BYTES=off)": []}
    size = 0
    for repeat in range(args.repeats):
        order = list(runs) if repeat % 2 == 0 else list(reversed(runs))
        for name in order:
            growth, size = one_run(name == "shared memory", args.mib)
            runs[name].append(growth)
            print(f"{name}: +{growth / 2**20:.0f} MiB ({growth / size:.2f}x the model)", flush=True)
    lines = [f"## --return of a {size / 2**20:.0f} MiB model from 2 ranks: the notebook's peak growth",
             "",
             f"`python benchmarks/bench_return.py --repeats {args.repeats}`: `launch()` of a function whose rank 0 "
             "returns a model of 4096x4096 float32 layers (as `%%ddp --return model`), the notebook's PSS sampled "
             "every 20 ms from another process, from after a warm-up job until the model is in the notebook and "
             "every one of its pages has been read (a mapped page counts once touched); medians, contenders "
             "alternating.",
             "",
             "| result travels | peak growth (MiB) | × the model | runs |",
             "| --- | --- | --- | --- |"]
    for name, growths in runs.items():
        median = statistics.median(growths)
        lines.append(f"| {name} | {median / 2**20:.0f} | {median / size:.2f} | "
                     f"{', '.join(f'{g / 2**20:.0f}' for g in growths)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS_return.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
