"""The GPU paths on real hardware, in one command: ``python benchmarks/gpu_check.py`` (at most 8 minutes on one GPU).

Writes ``benchmarks/RESULTS_gpu.md``: each check passed, failed (with what it saw) or not run (and why).

- the quickstart with ``%%ddp --gpus 1`` (NCCL) in a real kernel where CUDA was initialised first;
- ``--return`` of a CUDA model (a CPU copy arrives, equal to the rank's);
- a CUDA tensor of the notebook arriving on the rank's GPU;
- checkpoints saved on the GPU and loaded onto the rank's device (and onto the CPU in the notebook);
- the warm pool keeping a model on its GPU across cells, and recovering after an interrupt with work in flight;
- the picker's NVML readings against ``nvidia-smi``;
- two kernels asking for the same GPU at once: one gets it, the other is told who holds it;
- NCCL training throughput of ``launch()`` against torchrun on the same GPU.

``--cpu`` runs the same checks on CPU ranks (gloo) where they have a CPU meaning, and marks the GPU-only ones not
run: it proves the script, not the GPU, and it is what the test suite runs on machines without one.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
QUICKSTART = os.path.join(ROOT, "notebooks", "quickstart.ipynb")


@dataclass
class Check:
    name: str
    status: str  # "passed", "failed", "not run"
    detail: str
    seconds: float = 0.0


# -- nvidia-smi against NVML -----------------------------------------------------------------------------------

SMI_QUERY = "index,uuid,memory.used,memory.total,utilization.gpu"


def parse_smi(text: str) -> list[dict]:
    """``nvidia-smi --query-gpu=index,uuid,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits``."""
    rows = []
    for row in csv.reader(io.StringIO(text)):
        if not row or not row[0].strip():
            continue
        index, uuid, used, total, util = (cell.strip() for cell in row)
        rows.append({"index": int(index), "uuid": uuid, "used_mib": float(used), "total_mib": float(total),
                     "util": None if util in ("[N/A]", "N/A") else int(util)})
    return rows


def compare_readings(nvml_gpus: list, smi_rows: list[dict], tolerance_mib: float = 512) -> list[str]:
    """What differs between the picker's readings (``engine.devices.GPU``) and nvidia-smi's; [] when they agree.
    Memory in use moves between the two readings: within ``tolerance_mib``; totals and UUIDs exactly."""
    problems = []
    by_uuid = {row["uuid"]: row for row in smi_rows}
    if sorted(by_uuid) != sorted(g.uuid for g in nvml_gpus):
        problems.append(f"UUIDs differ: NVML {sorted(g.uuid for g in nvml_gpus)}, nvidia-smi {sorted(by_uuid)}")
    for gpu in nvml_gpus:
        row = by_uuid.get(gpu.uuid)
        if row is None:
            continue
        if abs(gpu.memory_total / 2**20 - row["total_mib"]) > 1:
            problems.append(f"GPU {gpu.uuid}: total {gpu.memory_total / 2**20:.0f} MiB, nvidia-smi {row['total_mib']:.0f}")
        if abs(gpu.memory_used / 2**20 - row["used_mib"]) > tolerance_mib:
            problems.append(f"GPU {gpu.uuid}: used {gpu.memory_used / 2**20:.0f} MiB, nvidia-smi {row['used_mib']:.0f}")
        if gpu.physical_index is not None and gpu.physical_index != row["index"]:
            problems.append(f"GPU {gpu.uuid}: NVML index {gpu.physical_index}, nvidia-smi {row['index']}")
    return problems


def check_nvml_against_smi(gpu: bool) -> Check:
    if not gpu or shutil.which("nvidia-smi") is None:
        return Check("picker's NVML readings = nvidia-smi", "not run", "no GPU (or no nvidia-smi) here")
    from ddp_notebook.engine import devices

    found, source = devices.discover_report()
    smi = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    problems = compare_readings(found, parse_smi(smi))
    detail = f"{len(found)} GPU(s) by {source}; " + ("; ".join(problems) if problems else "UUIDs, indices, totals "
                                                      "equal; memory in use within 512 MiB")
    return Check("picker's NVML readings = nvidia-smi", "failed" if problems else "passed", detail)


# -- a real kernel ---------------------------------------------------------------------------------------------

class Kernel:
    """A fresh python3 kernel; ``run(code)`` returns what it printed and its error, if any."""

    def __init__(self):
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=ROOT)

    def run(self, code: str, timeout: float = 300) -> tuple[str, str | None]:
        out, error = [], []

        def collect(msg):
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                error.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

        self.kc.execute_interactive(code, timeout=timeout, output_hook=collect)
        return "".join(out), (error[0] if error else None)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def quickstart_cells(devices_flag: str) -> list[str]:
    """The quickstart notebook's code cells, its %%ddp cell run with ``devices_flag``."""
    with open(QUICKSTART) as f:
        cells = ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
    return [c.replace("%%ddp ", f"%%ddp {devices_flag} ", 1) if c.startswith("%%ddp") else c for c in cells]


def _expect(kernel: Kernel, code: str, *wanted: str) -> str:
    out, error = kernel.run(code)
    if error:
        raise AssertionError(f"{error}\n{out[-1500:]}")
    missing = [w for w in wanted if w not in out]
    if missing:
        raise AssertionError(f"missing {missing!r} in:\n{out[-1500:]}")
    return out


def kernel_checks(gpu: bool) -> list[Check]:
    """The checks that run in one kernel, in order; each is timed and caught on its own."""
    flag, dev = ("--gpus 1", "cuda") if gpu else ("--cpus 1", "cpu")
    kernel = Kernel()
    checks = []

    def run(name: str, body, gpu_only: bool = False):
        if gpu_only and not gpu:
            checks.append(Check(name, "not run", "needs a GPU"))
            return
        started = time.perf_counter()
        try:
            detail = body()
            checks.append(Check(name, "passed", detail, time.perf_counter() - started))
        except Exception as exc:  # noqa: BLE001 - every check is reported
            checks.append(Check(name, "failed", f"{type(exc).__name__}: {exc}", time.perf_counter() - started))

    def quickstart():
        if gpu:
            _expect(kernel, "import torch; torch.zeros(1, device='cuda'); print('CUDA in the kernel:', "
                            "torch.cuda.is_initialized())", "CUDA in the kernel: True")
        cells = quickstart_cells(flag)
        for cell in cells[:-1]:
            out = _expect(kernel, cell)
        out = _expect(kernel, "import ddp_notebook\nprint('BACKEND', ddp_notebook.last_job().spec.backend)\n"
                              "print('ACC', accuracy(model, val_set.tensors[0], val_set.tensors[1]))\n"
                              "print('ON', next(model.parameters()).device)", "ON cpu")
        backend = out.split("BACKEND ")[1].split()[0]
        acc = float(out.split("ACC ")[1].split()[0])
        if backend != ("nccl" if gpu else "gloo") or acc <= 0.9:
            raise AssertionError(f"backend {backend}, validation accuracy {acc:.3f}")
        return f"{flag}: backend {backend}, validation accuracy {acc:.3f} in the notebook, model back on the CPU"

    def returned_model():
        out = _expect(kernel, f"%%ddp {flag} --return m\nimport torch\ntorch.manual_seed(1)\n"
                              "m = torch.nn.Linear(64, 64).to(device)\n"
                              "print('RANK', next(m.parameters()).device, float(m.weight.double().sum()))",
                      f"RANK {dev}")
        rank_sum = float(out.split("RANK ")[1].split()[1])
        out = _expect(kernel, "print('NB', next(m.parameters()).device, float(m.weight.double().sum()))", "NB cpu")
        here = float(out.split("NB cpu ")[1].split()[0])
        if here != rank_sum:
            raise AssertionError(f"the rank's weights sum to {rank_sum!r}, the notebook's to {here!r}")
        return f"a {dev} model came back as a CPU copy with equal weights (sum {here:.6f})"

    def payload_tensor():
        _expect(kernel, f"import torch\nt = torch.arange(1000., device={dev!r}).reshape(10, 100)[:, ::3]")
        out = _expect(kernel, f"%%ddp {flag}\nprint('GOT', t.device, float(t.double().sum()), t.is_contiguous())",
                      "GOT")
        expected = float(__import__("torch").arange(1000.).reshape(10, 100)[:, ::3].double().sum())
        got = out.split("GOT ")[1].split()
        if got[0] != (f"{dev}:0" if gpu else "cpu") or float(got[1]) != expected:
            raise AssertionError(f"the rank got {got}, expected {dev} and sum {expected}")
        return f"a strided {dev} tensor of the notebook arrived on {got[0]} with equal values"

    def checkpoints():
        path = os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "ckpt.pt")
        out = _expect(kernel, f"%%ddp {flag}\nimport torch\nfrom ddp_notebook import save_checkpoint, load_checkpoint\n"
                              f"net = torch.nn.Linear(8, 8).to(device)\nsave_checkpoint({path!r}, net, epoch=3)\n"
                              f"other = torch.nn.Linear(8, 8).to(device)\nloaded = load_checkpoint({path!r}, other)\n"
                              "print('LOADED', next(other.parameters()).device, loaded.epoch, "
                              "bool(torch.equal(other.weight, net.weight)))", "LOADED")
        got = out.split("LOADED ")[1].split()
        if got != [f"{dev}:0" if gpu else "cpu", "3", "True"]:
            raise AssertionError(f"loaded onto {got}")
        out = _expect(kernel, "import torch\nfrom ddp_notebook import load_checkpoint\nhere = torch.nn.Linear(8, 8)\n"
                              f"load_checkpoint({path!r}, here)\nprint('NB', next(here.parameters()).device)", "NB cpu")
        return f"saved on {got[0]}, loaded onto the rank's {got[0]} and onto the notebook's CPU"

    def pool():
        _expect(kernel, f"%ddp_start {flag}")
        try:
            _expect(kernel, "%%ddp\nimport torch\nkept = torch.nn.Linear(4, 4).to(device)\nkept_id = id(kept)")
            out = _expect(kernel, "%%ddp\nprint('KEPT', next(kept.parameters()).device, id(kept) == kept_id)", "KEPT")
        finally:
            kernel.run("%ddp_stop")
        got = out.split("KEPT ")[1].split()
        if got != [f"{dev}:0" if gpu else "cpu", "True"]:
            raise AssertionError(f"the pool's model in the next cell: {got}")
        return f"the same model object stayed on {got[0]} across cells"

    try:
        run("quickstart %%ddp in a kernel" + (" where CUDA was initialised first" if gpu else ""), quickstart)
        run("--return of a model on the rank's device", returned_model)
        run("a tensor of the notebook on the rank's device", payload_tensor)
        run("checkpoints onto the rank's device and the notebook's CPU", checkpoints)
        run("warm pool keeps a model on its device across cells", pool)
    finally:
        kernel.close()
    return checks


# -- reservations: two kernels, one GPU ------------------------------------------------------------------------

def check_reservation(gpu: bool) -> Check:
    if not gpu:
        return Check("two kernels, one GPU: no double booking", "not run", "needs a GPU (tests/test_reservations.py "
                     "runs the race on fake GPUs)")
    first, second = Kernel(), Kernel()
    started = time.perf_counter()
    try:
        _expect(first, "%load_ext ddp_notebook\n%ddp_start --gpus 1")
        second.run("%load_ext ddp_notebook")
        out, error = second.run("%%ddp --gpus 1\nprint('RAN')")
        ok = error is not None and "free of other jobs' reservations" in error and "RAN" not in out
        return Check("two kernels, one GPU: no double booking", "passed" if ok else "failed",
                     (error or out)[-300:], time.perf_counter() - started)
    finally:
        first.run("%ddp_stop")
        first.close()
        second.close()


# -- the warm pool after an interrupt with collectives in flight (gpu-review item 6) ----------------------------

def _queues_then_sleeps(marks: str, spin_cycles: int):
    """A pool cell: GPU work and an all_reduce queued (not waited for), then a sleep the interrupt ends."""
    import os
    import time

    import torch
    import torch.distributed as dist

    import ddp_notebook

    x = torch.ones(1 << 20, device=ddp_notebook.rank_context().device)
    if x.is_cuda and spin_cycles:
        torch.cuda._sleep(spin_cycles)  # the device is busy: the collective below waits behind it
    dist.all_reduce(x, async_op=True)
    open(os.path.join(marks, str(dist.get_rank())), "w").close()
    time.sleep(3600)


def _pool_sum_and_pid():
    import os

    import torch
    import torch.distributed as dist

    import ddp_notebook

    t = torch.ones(1, device=ddp_notebook.rank_context().device)
    dist.all_reduce(t)
    return t.item(), os.getpid()


def _interrupted_pool_cell(warm, spin_cycles: int) -> str:
    """Interrupt one pool cell once its ranks have queued their work; what the pool printed."""
    import contextlib
    import signal
    import threading

    import ddp_notebook

    marks = tempfile.mkdtemp(prefix="gpu-check-")
    main_thread = threading.main_thread().ident

    def interrupt():
        deadline = time.monotonic() + 120
        while len(os.listdir(marks)) < warm.spec.world_size and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        signal.pthread_kill(main_thread, signal.SIGINT)

    told = io.StringIO()
    # (A shell starts a command run in the background, `gpu_check.py &`, with SIGINT ignored, and Python keeps it
    # so: the interrupt below would never come.)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    with contextlib.redirect_stderr(told):
        try:
            ddp_notebook.launch(_queues_then_sleeps, args=(marks, spin_cycles))
        except KeyboardInterrupt:
            pass
        else:
            raise AssertionError("the cell was not interrupted")
    shutil.rmtree(marks, ignore_errors=True)
    return told.getvalue()


def check_pool_interrupt(gpu: bool) -> Check:
    """With one GPU the world is one rank, so no collective can be left unmatched: what this proves is the
    post-interrupt path on a real device and NCCL.  (1) A cell interrupted with GPU work and an all_reduce still
    queued: ``torch.cuda.synchronize()`` lets them finish, the sentinel all_reduce on the device sums right, the
    pool keeps its rank, the next all_reduce is right.  (2) GPU only: a cell that leaves the device spinning
    (``torch.cuda._sleep``, as a collective waiting for a peer would) makes the bounded synchronize time out,
    and the pool restarts saying so; the next cell is right on the fresh rank.  tests/test_pool_interrupt.py
    shows a truly unmatched collective on 2 CPU ranks."""
    name = "warm pool after an interrupt with collectives in flight"
    import ddp_notebook  # noqa: F401 - the pool's launch()
    from ddp_notebook.engine import pool
    from ddp_notebook.engine import spec as job_spec

    started = time.perf_counter()
    warm = pool.Pool(job_spec.resolve_devices(gpus=1) if gpu else job_spec.resolve_devices(cpus=1)).start()
    try:
        before = ddp_notebook.launch(_pool_sum_and_pid)[0]
        told = _interrupted_pool_cell(warm, int(2e9) if gpu else 0)  # about a second of spinning on a GPU
        after = ddp_notebook.launch(_pool_sum_and_pid)[0]
        if "the warm pool's ranks are back and keep their state" not in told or after != (1.0, before[1]):
            raise AssertionError(f"after a cell with queued work: {after} (before {before}); it said {told[-500:]!r}")
        detail = f"queued work and all_reduce finished after the interrupt; the pool kept its rank, sum {after[0]}"
        if gpu:
            told = _interrupted_pool_cell(warm, int(2e11))  # spins for minutes: never within the check's bound
            fresh = ddp_notebook.launch(_pool_sum_and_pid)[0]
            if "the GPU's queued work did not finish within" not in told or warm.restarts != 1 \
                    or fresh[0] != 1.0 or fresh[1] == before[1]:
                raise AssertionError(f"after a cell that left the GPU spinning: {fresh}, {warm.restarts} "
                                     f"restart(s); it said {told[-500:]!r}")
            detail += "; a device left spinning made the pool restart with a clear line, next sum right"
        return Check(name, "passed", detail, time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - every check is reported
        return Check(name, "failed", f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
    finally:
        warm.stop()


# -- NCCL throughput against torchrun --------------------------------------------------------------------------

def train_steps(steps: int = 300, warmup: int = 20, batch: int = 256) -> float:
    """Samples per second of a small DDP CNN on this rank's device, timed after a warm-up."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Flatten(), nn.Linear(128 * 8 * 8, 10)).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32, device=device), torch.randint(0, 10, (batch,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return steps * batch * dist.get_world_size() / (time.perf_counter() - started)


def check_throughput(gpu: bool, repeats: int = 3) -> Check:
    if not gpu:
        return Check("NCCL throughput: launch() / torchrun", "not run", "needs a GPU")
    import ddp_notebook

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    rates = {"launch()": [], "torchrun": []}
    started = time.perf_counter()
    for rep in range(repeats):
        for who in (["launch()", "torchrun"] if rep % 2 == 0 else ["torchrun", "launch()"]):
            if who == "launch()":
                rates[who].append(ddp_notebook.launch(train_steps, gpus=1)[0])
            else:
                out = subprocess.run([torchrun, "--nproc-per-node", "1", os.path.abspath(__file__), "--torchrun-rank"],
                                     capture_output=True, text=True, check=True, timeout=300).stdout
                rates[who].append(float(out.split("RATE ")[1].split()[0]))
    import statistics

    ratio = statistics.median(rates["launch()"]) / statistics.median(rates["torchrun"])
    detail = (f"samples/s, medians of {repeats}: launch() {statistics.median(rates['launch()']):.0f}, torchrun "
              f"{statistics.median(rates['torchrun']):.0f}; ratio {ratio:.3f} (target ≥ 0.98)")
    return Check("NCCL throughput: launch() / torchrun", "passed" if ratio >= 0.98 else "failed", detail,
                 time.perf_counter() - started)


def _torchrun_rank() -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rate = train_steps()
    if dist.get_rank() == 0:
        print("RATE", rate, flush=True)
    dist.destroy_process_group()


# -- the report ------------------------------------------------------------------------------------------------

def machine() -> str:
    import torch

    parts = [f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch "
             f"{torch.__version__} (CUDA {torch.version.cuda})"]
    if torch.cuda.is_available():
        parts.append(", ".join(f"GPU {i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())))
    else:
        parts.append("no CUDA device")
    return "; ".join(parts)


def report(checks: list[Check], gpu: bool, seconds: float) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in ("passed", "failed", "not run")}
    lines = ["# GPU check", "",
             f"Written by `python benchmarks/gpu_check.py{'' if gpu else ' --cpu'}` on "
             f"{time.strftime('%Y-%m-%d %H:%M')}; {seconds:.0f} s in all.", "",
             f"Machine: {machine()}.", ""]
    if not gpu:
        lines += ["**A CPU run: it proves the script, not the GPU paths.** The checks ran on CPU ranks (gloo) where "
                  "they have a CPU meaning; the GPU-only ones did not run.", ""]
    lines += [f"{counts['passed']} passed, {counts['failed']} failed, {counts['not run']} not run.", "",
              "| check | result | seconds | what it saw |", "| --- | --- | --- | --- |"]
    for c in checks:
        lines.append(f"| {c.name} | {c.status} | {c.seconds:.1f} | {c.detail.replace('|', '/').replace(chr(10), ' ')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU ranks: proves the script, not the GPU")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS_gpu.md"))
    parser.add_argument("--torchrun-rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.torchrun_rank:
        _torchrun_rank()
        return 0
    import torch

    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --cpu to check the script on CPU ranks", file=sys.stderr)
        return 2
    started = time.perf_counter()
    checks = [check_nvml_against_smi(gpu)] + kernel_checks(gpu) + [check_pool_interrupt(gpu), check_reservation(gpu),
                                                                     check_throughput(gpu)]
    text = report(checks, gpu, time.perf_counter() - started)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 1 if any(c.status == "failed" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
