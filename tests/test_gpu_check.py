"""benchmarks/gpu_check.py where there is no GPU: its CPU run (which proves the script, not the GPU paths), its
comparison of NVML with nvidia-smi on the recorded server, and its refusal to pretend."""
import os
import subprocess
import sys

import pytest

import fake_nvml
from conftest import ROOT
from ddp_notebook.engine import devices as gpus

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402

# What nvidia-smi prints for the recorded server (tests/fake_nvml.py), as --query-gpu=... --format=csv,noheader,nounits
SMI = "".join(f"{index}, {fake_nvml.UUIDS[index]}, {used}, 81920, {util}\n"
              for index, used, util, _ in fake_nvml.RECORDED)


def test_nvml_readings_are_compared_with_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setenv("DDP_NOTEBOOK_RESERVATIONS", str(tmp_path))
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8())
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    found = gpus.discover()
    rows = gpu_check.parse_smi(SMI)
    assert [r["index"] for r in rows] == list(range(8)) and rows[4]["util"] == 100
    assert gpu_check.compare_readings(found, rows) == []
    moved = SMI.replace(f"2, {fake_nvml.UUIDS[2]}, 40960", f"2, {fake_nvml.UUIDS[2]}, 50000")
    assert gpu_check.compare_readings(found, gpu_check.parse_smi(moved)) == [
        f"GPU {fake_nvml.UUIDS[2]}: used 40960 MiB, nvidia-smi 50000"]
    swapped = SMI.replace(f"0, {fake_nvml.UUIDS[0]}", "9, " + fake_nvml.UUIDS[0])
    assert gpu_check.compare_readings(found, gpu_check.parse_smi(swapped)) == [
        f"GPU {fake_nvml.UUIDS[0]}: NVML index 0, nvidia-smi 9"]


def test_without_a_gpu_it_refuses_to_run_the_gpu_checks():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no CUDA device here; run with --cpu" in proc.stderr


@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.timeout(300)
def test_the_cpu_run_passes_every_check_with_a_cpu_meaning_and_says_what_it_proves(tmp_path, no_leftovers):
    out = tmp_path / "RESULTS_gpu.md"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--cpu", "--out",
                           str(out)], capture_output=True, text=True, timeout=280, cwd=ROOT)
    text = out.read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "**A CPU run: it proves the script, not the GPU paths.**" in text
    assert "6 passed, 0 failed, 3 not run." in text
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| check") and not line.startswith("| ---")}
    assert rows["NCCL throughput: launch() / torchrun"] == "not run"
    assert rows["--return of a model on the rank's device"] == "passed"
    assert rows["warm pool after an interrupt with collectives in flight"] == "passed"
