"""What a dataset costs when a 2-rank job reads it: a Hugging Face ``datasets.Dataset`` against a tensor of the same
size, every process's PSS (the notebook's and its descendants': the rank template and the ranks) sampled from outside.

``python benchmarks/bench_hfdata.py [--repeats N] [--rows R]`` writes ``RESULTS_hfdata.md``.  Each run is a new
process playing the notebook: it builds ``R`` x 128 float32 values (256 MB for the default 500,000 rows) as one of

- ``tensor``: a ``TensorDataset`` of one tensor;
- ``hf memory``: ``datasets.Dataset.from_dict({"x": x}).with_format("torch")``, in memory (Arrow buffers);
- ``hf memory, read as Arrow``: the same, the ranks reading the Arrow column itself (``pyarrow.compute``) instead of
  torch-formatted batches, whose conversions leave glibc heap behind in each rank;
- ``hf memory not shared``: the same with ``DDP_NOTEBOOK_SHARE_MIN_BYTES=off`` (how every Arrow buffer travelled
  before: pickled into the payload, a copy in every rank);
- ``hf memory-mapped``: the same saved with ``save_to_disk`` and opened with ``load_from_disk`` (the notebook reads
  every row before the job, so its pages are in the baseline);
- ``pandas``: a ``DataFrame`` of 128 float32 columns;

runs a warm-up job and has the rank template preload the notebook's libraries as it does after a cell in a kernel
(the notebook imports datasets and pandas in every variant, so the rows differ only by the data), then
``launch()``es a function that reads every row of the data in batches (``--batch``: 256 rows, as a training loader
reads, and 16,384) on both ranks.  The driver samples the PSS of the notebook and
all its descendants every 20 ms (``pss_sampler.rollup``) from the moment the notebook has its data until the job has
returned: the growth is the peak total over the total before the job.  The contenders alternate, the order rotating
every repeat; medians.
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
from pss_sampler import INTERVAL_S, descendants, rollup  # noqa: E402

NOTEBOOK = r"""
import os, sys, tempfile, time
import numpy as np, torch, datasets, pandas, ddp_notebook
from ddp_notebook.engine import template

kind, rows, BATCH = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ARROW_READ = kind.endswith("read as Arrow")
kind = kind.replace(", read as Arrow", "")


def make(rows):
    x = np.random.default_rng(0).random((rows, 128), dtype=np.float32)
    if kind == "tensor":
        return torch.utils.data.TensorDataset(torch.from_numpy(x))
    if kind == "pandas":
        import pandas as pd
        return pd.DataFrame(x)
    import datasets
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"x": x}).with_format("torch")
    if kind == "hf memory-mapped":
        folder = tempfile.mkdtemp()
        ds.save_to_disk(folder)
        ds = datasets.load_from_disk(folder).with_format("torch")
    return ds


def read_all(data):
    import pandas
    import torch.distributed as dist
    total = 0.0
    n = len(data)
    for i in range(0, n, BATCH):
        if isinstance(data, torch.utils.data.TensorDataset):
            batch = data.tensors[0][i:i + BATCH]
        elif isinstance(data, pandas.DataFrame):
            batch = data.iloc[i:i + BATCH].to_numpy()
        elif ARROW_READ:  # the shared Arrow buffers themselves, no formatting
            import pyarrow.compute as pc
            batch = pc.list_flatten(data.data.table.slice(i, BATCH).column("x")).to_numpy()
        else:
            batch = data[i:i + BATCH]["x"]
        total += float(batch.sum())
    dist.barrier()
    return total


data = make(rows)
if kind == "hf memory-mapped":
    total = sum(float(data[i:i + BATCH]["x"].sum()) for i in range(0, len(data), BATCH))  # its pages in the baseline
ddp_notebook.launch(read_all, (make(BATCH),), cpus=2)  # warm-up: the template started
template.preload_notebook_libraries()  # as after a cell in a kernel: the template imports datasets and pandas
assert template.current().wait_preloaded()
print("ready", flush=True)
sys.stdin.readline()
started = time.perf_counter()
ddp_notebook.launch(read_all, (data,), cpus=2)
print("done", time.perf_counter() - started, flush=True)
sys.stdin.readline()
"""

KINDS = ["tensor", "hf memory", "hf memory, read as Arrow", "hf memory not shared", "hf memory-mapped", "pandas"]


def tree_pss(root: int) -> dict[int, dict]:
    """PSS (and its shared-memory part) of ``root`` and each of its descendants, by pid."""
    parts = {}
    for pid in [root, *descendants(root)]:
        found = rollup(pid)
        if found is not None:
            parts[pid] = found
    return parts


def _total(parts: dict[int, dict], key: str = "pss") -> int:
    return sum(p.get(key, 0) for p in parts.values())


def _mib(parts: dict[int, int]) -> str:
    return " ".join(f"{pid}:{p['pss'] / 2**20:.0f}" for pid, p in parts.items())


def one_run(kind: str, rows: int, batch: int) -> tuple[int, int, float]:
    """(peak PSS growth of the notebook and its descendants, the part of it in shared memory, the job's seconds)."""
    env = dict(os.environ)
    if kind.endswith("not shared"):
        env["DDP_NOTEBOOK_SHARE_MIN_BYTES"] = "off"
    notebook_kind = kind.replace(" not shared", "")
    proc = subprocess.Popen([sys.executable, "-c", NOTEBOOK, notebook_kind, str(rows), str(batch)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line == "ready", line
        time.sleep(1.0)  # the warm-up ranks gone
        base_parts = tree_pss(proc.pid)
        base = _total(base_parts)
        peak = [base, base_parts]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                parts = tree_pss(proc.pid)
                if _total(parts) > peak[0]:
                    peak[:] = [_total(parts), parts]
                time.sleep(INTERVAL_S)

        sampler = threading.Thread(target=sample)
        sampler.start()
        proc.stdin.write("\n")
        proc.stdin.flush()
        words = proc.stdout.readline().split()
        stop.set()
        sampler.join()
        assert words and words[0] == "done", words
        print(f"  before (pid:MiB) {_mib(base_parts)}; at the peak {_mib(peak[1])}", flush=True)
        return peak[0] - base, _total(peak[1], "shmem") - _total(base_parts, "shmem"), float(words[1])
    finally:
        proc.stdin.close()
        proc.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--batch", type=int, nargs="+", default=[256, 16384],
                        help="rows per batch the ranks read (each size a row of its own)")
    parser.add_argument("--only", default=";".join(KINDS), help="kinds, separated by ';'")
    args = parser.parse_args()
    kinds = [k for k in KINDS if k in args.only.split(";")]
    size = args.rows * 128 * 4
    contenders = [(kind, batch) for batch in args.batch for kind in kinds]
    runs: dict[tuple[str, int], list[tuple[int, int, float]]] = {k: [] for k in contenders}
    for repeat in range(args.repeats):
        order = contenders[repeat % len(contenders):] + contenders[:repeat % len(contenders)]
        for kind, batch in order:
            growth, shmem, seconds = one_run(kind, args.rows, batch)
            runs[kind, batch].append((growth, shmem, seconds))
            print(f"{kind}, batches of {batch}: +{growth / 2**20:.0f} MiB ({growth / size:.2f}x the data; shared "
                  f"memory "
                  f"+{shmem / 2**20:.0f} MiB), {seconds:.2f} s", flush=True)
    lines = [f"## A {size / 2**20:.0f} MiB dataset read by 2 ranks: PSS growth of the notebook, template and ranks",
             "",
             f"`python benchmarks/bench_hfdata.py --repeats {args.repeats} --rows {args.rows} --batch "
             f"{' '.join(map(str, args.batch))}`: {args.rows:,} x 128 "
             "float32 in the notebook, a `launch()` on 2 CPU ranks that reads every row in batches on both ranks "
             "(the notebook imported datasets and pandas, and the rank template preloaded them, in every row); the PSS of the notebook and all its descendants "
             "summed, sampled every 20 ms from another process, peak during the job over the total before it; "
             "the job's wall time in the notebook. Medians; contenders alternating.",
             "",
             "| data | rows a batch | growth (MiB) | × the data | of which shared memory (MiB) | job (s) | runs (MiB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (kind, batch), results in runs.items():
        growth = statistics.median(g for g, _, _ in results)
        shmem = statistics.median(m for _, m, _ in results)
        seconds = statistics.median(s for _, _, s in results)
        lines.append(f"| {kind} | {batch:,} | {growth / 2**20:.0f} | {growth / size:.2f} | {shmem / 2**20:.0f} | {seconds:.2f} | "
                     f"{', '.join(f'{g / 2**20:.0f}' for g, _, _ in results)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "RESULTS_hfdata.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
