"""The main job: `python -m ddp_notebook demo` trains on 2 CPU ranks with per-epoch lines."""
import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_demo_trains_to_90_percent_with_per_epoch_lines(no_leftovers):
    done = subprocess.run([sys.executable, "-m", "ddp_notebook", "demo", "--cpus", "2"], capture_output=True,
                          text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    epochs = re.findall(r"^epoch (\d+)/12 .*train_loss [\d.]+ .*val_acc ([\d.]+)", done.stdout, re.M)
    assert [int(e) for e, _ in epochs] == list(range(1, 13))
    accuracy = float(re.search(r"validation accuracy ([\d.]+) on 2 ranks", done.stdout).group(1))
    assert accuracy >= 0.9
    assert float(epochs[-1][1]) == pytest.approx(accuracy, abs=1e-3)
