"""The benchmarks still run (tiny sizes, one run each): a smoke check, not a timed test."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


@pytest.mark.timeout(300)
def test_the_memory_dump_and_report_benchmarks_run_and_write_their_tables(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--smoke", "--only",
                    "memory,memory_small,dump_load,report", "--out", str(out)], check=True, cwd=ROOT, timeout=280)
    text = out.read_text()
    for heading in ("## Machine", "## Memory", "## Dump and load", "## report()"):
        assert heading in text
    assert "launch() after `%load_ext ddp_notebook`" in text and "fork (torch.multiprocessing" in text
    assert "samples of 32×32×3" in text and "samples of 63 features" in text  # both dataset shapes
    assert (tmp_path / "results.json").exists()
