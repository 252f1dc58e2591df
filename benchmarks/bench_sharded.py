"""Sharded models (FSDP2) on 2 CPU ranks: what ``save_checkpoint`` costs over ``torch.distributed.checkpoint.save``
alone, and the memory peak of gathering the model for ``--return``.

``python benchmarks/bench_sharded.py [--mib 1024] [--repeats 5]`` prints one JSON object (RESULTS_sharded.md is
written from it).  Each part runs in a process of its own playing the notebook (``launch()`` on 2 fresh ranks).

- save: the same ranks alternate ``save_checkpoint(path, model)`` and ``dcp.save({"model":
  get_model_state_dict(model)})`` into new folders (the order flips every repeat); each call is timed on rank 0
  between barriers; the ratio is of the medians.
- gather: a run that returns the model and one that returns None, the same model otherwise (built on the meta
  device and sharded before any rank holds it whole); every process's PSS is sampled every 20 ms from here
  (``pss_sampler.rollup``); a process's cost of the gather is its peak in the first run over its peak in the second,
  and the whole tree's (notebook and ranks summed at each sample: pages they share, such as the results file rank 0
  gathers into and the notebook maps, count once) its peak total in the first run over that of the second.  The
  notebook has imported torch in both runs, as a notebook that trains has.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pss_sampler import descendants, rollup  # noqa: E402

WIDTH = 4096  # a Linear(WIDTH, WIDTH) layer: 64 MiB of fp32 weights


def _sharded_model(mib: int):
    """Rank side: layers of WIDTH x WIDTH fp32 weights, ``mib`` MiB in all, sharded before they are allocated."""
    import torch
    from torch.distributed.fsdp import fully_shard

    layers = max(1, mib * 2**20 // (WIDTH * WIDTH * 4))
    with torch.device("meta"):
        model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    return model


def _save_task(mib: int, repeats: int, folder: str):
    import shutil
    import time

    import torch.distributed as dist
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    import ddp_notebook

    model = _sharded_model(mib)
    rank = dist.get_rank()

    def toolkit(path):
        ddp_notebook.save_checkpoint(path, model)

    def dcp_alone(path):
        dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(path))

    times: dict[str, list[float]] = {"save_checkpoint": [], "dcp.save": []}
    contenders = [("save_checkpoint", toolkit), ("dcp.save", dcp_alone)]
    for repeat in range(repeats + 1):  # the first round warms up (imports, page cache): not counted
        for name, call in (contenders if repeat % 2 == 0 else contenders[::-1]):
            path = os.path.join(folder, f"{name}-{repeat}")
            dist.barrier()
            started = time.perf_counter()
            call(path)
            dist.barrier()
            if repeat:
                times[name].append(time.perf_counter() - started)
            if rank == 0:
                shutil.rmtree(path)
    return times


def _gather_task(mib: int, returns: bool, folder: str):
    import torch.distributed as dist

    with open(os.path.join(folder, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    model = _sharded_model(mib)
    dist.barrier()
    return model if returns else None


def _child(part: str, mib: int, repeats: int, returns: bool, folder: str) -> None:
    """The process playing the notebook."""
    import ddp_notebook

    if part == "save":
        times = ddp_notebook.launch(_save_task, args=(mib, repeats, folder), cpus=2)[0]
        print(json.dumps(times))
    else:
        import torch  # noqa: F401 - a notebook that trains has (and the returned model needs it)

        result = ddp_notebook.launch(_gather_task, args=(mib, returns, folder), cpus=2)[0]
        whole = sum(p.numel() * p.element_size() for p in result.parameters()) if returns else 0
        if returns:
            sum(float(p.detach().sum()) for p in result.parameters())  # the notebook reads every page of the result
        time.sleep(1)  # ... and holds it, sampled
        print(json.dumps({"returned_bytes": whole}))


def _run(args: list[str], sample: bool = False) -> tuple[dict, dict, int]:
    """Run a child; its JSON line, when sampled every process's peak PSS in bytes by pid (and under "total" the
    peak of their sum), and the child's pid."""
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args], stdout=subprocess.PIPE, text=True)
    peaks: dict = {}
    while sample and proc.poll() is None:
        tick = time.perf_counter()
        total = 0
        for pid in [proc.pid, *descendants(proc.pid)]:
            found = rollup(pid)
            if found is not None:
                peaks[pid] = max(peaks.get(pid, 0), found["pss"])
                total += found["pss"]
        peaks["total"] = max(peaks.get("total", 0), total)
        time.sleep(max(0.0, 0.02 - (time.perf_counter() - tick)))
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"bench_sharded: {' '.join(args)} failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]), peaks, proc.pid


def _gather_peaks(mib: int, returns: bool) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        told, peaks, notebook = _run(["--child", "gather", "--mib", str(mib), *(["--returns"] if returns else []),
                                      "--folder", folder], sample=True)
        ranks = {}
        for rank in (0, 1):
            with open(os.path.join(folder, f"rank{rank}.pid")) as f:
                ranks[f"rank {rank}"] = peaks.get(int(f.read()), 0)
    return {**ranks, "notebook": peaks[notebook], "total": peaks["total"], **told}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024, help="the model's size (fp32 weights), MiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", choices=["save", "gather"], help=argparse.SUPPRESS)
    parser.add_argument("--gather-only", action="store_true", help="measure the gather's memory alone")
    parser.add_argument("--returns", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.mib, args.repeats, args.returns, args.folder)
        return
    model_bytes = args.mib * 2**20
    times: dict = {}
    if not args.gather_only:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_SHARDED_DIR")) as folder:
            times, _, _ = _run(["--child", "save", "--mib", str(args.mib), "--repeats", str(args.repeats),
                                "--folder", folder])
    medians = {name: statistics.median(values) for name, values in times.items()}
    returning, baseline = _gather_peaks(args.mib, True), _gather_peaks(args.mib, False)
    assert returning["returned_bytes"] == model_bytes, returning
    over = {who: returning[who] - baseline[who] for who in ("rank 0", "rank 1", "notebook", "total")}
    print(json.dumps({
        "model_mib": args.mib,
        "save_s": times, "save_median_s": medians,
        "save_ratio": medians["save_checkpoint"] / medians["dcp.save"] if medians else None,
        "gather_peak_pss_mib": {"returning": {k: returning[k] / 2**20 for k in over},
                                "returning None": {k: baseline[k] / 2**20 for k in over}},
        "gather_over_model": {who: over[who] / model_bytes for who in ("rank 0", "notebook", "total")},
        "gather_over_shard": {"rank 1": over["rank 1"] / (model_bytes / 2)},
    }, indent=1))


if __name__ == "__main__":
    main()
