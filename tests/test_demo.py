"""The main job: `python -m ddp_notebook demo` trains on 2 CPU ranks with per-epoch lines."""
import re
import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_demo_trains_to_90_percent_with_per_epoch_lines(no_leftovers):
    done = subprocess.run([sys.executable, "-m", "ddp_notebook", "demo", "--cpus", "2"], capture_output=True,
                          text=True, timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    epochs = re.findall(r"^epoch (\d+)/12 .*train_loss [\d.]+ .*val_acc ([\d.]+)", done.stdout, re.M)
    assert [int(e) for e, _ in epochs] == list(range(1, 13))
    accuracy = float(re.search(r"validation accuracy ([\d.]+) on 2 ranks", done.stdout).group(1))
    assert accuracy >= 0.9
    assert float(epochs[-1][1]) == pytest.approx(accuracy, abs=1e-3)


def test_the_command_line_refuses_in_one_line_and_shows_plain_help():
    refused = subprocess.run([sys.executable, "-m", "ddp_notebook", "demo", "--gpus", "4096"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert re.fullmatch(r"python -m ddp_notebook demo: error: 4096 GPUs asked for, but this machine has .*\n",
                        refused.stderr), refused.stderr
    for command in ([], ["demo"]):
        shown = subprocess.run([sys.executable, "-m", "ddp_notebook", *command, "--help"], capture_output=True,
                               text=True, timeout=60)
        assert shown.returncode == 0 and "usage: python -m ddp_notebook" in shown.stdout
        assert "``" not in shown.stdout
