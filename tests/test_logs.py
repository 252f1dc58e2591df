"""job.logs(rank) and --log-dir: every rank's complete output, also what the cell elided."""
import io
import os
import re

import numpy as np
import pytest

from ddp_notebook.engine import output
from nbrun import kernel


@pytest.mark.slow
@pytest.mark.kernel
def test_job_logs_hold_the_lines_the_cell_elided_and_log_dir_writes_them_all(tmp_path, no_leftovers):
    log_dir = tmp_path / "logs"
    with kernel("%load_ext ddp_notebook\nimport ddp_notebook") as (km, kc):
        told = []
        kc.execute_interactive(
            f"%%ddp --cpus 2 --output 0 --log-dir {log_dir}\nfor i in range(30000):\n    print('line', rank, i)\n"
            "import sys\nprint('to stderr', rank, file=sys.stderr)",
            timeout=180, output_hook=lambda m: told.append(m["content"].get("text", "")))
        shown = "".join(told)
        assert re.search(r"\d+ lines of rank 0 elided", shown), shown[-500:]
        assert "line 0 0\n" not in shown and "line 1 " not in shown  # elided, and rank 1 not shown (--output 0)
        check = []
        kc.execute_interactive(
            "job = ddp_notebook.last_job()\n"
            "for r in (0, 1):\n"
            "    lines = job.logs(r).splitlines()\n"
            "    print(r, len(lines), lines[0], '|', lines[-1], '|', sum(l == f'line {r} {i}' for i, l in "
            "enumerate(lines[:30000])))",
            timeout=60, output_hook=lambda m: check.append(m["content"].get("text", "")))
        assert "".join(check).splitlines() == [
            f"{r} 30001 line {r} 0 | to stderr {r} | 30000" for r in (0, 1)], check
    for r in (0, 1):
        lines = (log_dir / f"rank{r}.log").read_text().splitlines()
        assert lines[:2] == [f"line {r} 0", f"line {r} 1"] and len(lines) == 30001 and lines[-1] == f"to stderr {r}"
    assert sorted(os.listdir(log_dir)) == ["rank0.log", "rank1.log"]


def _says_hello():
    import torch.distributed as dist

    print("hello from", dist.get_rank())


def test_the_logs_of_a_rank_the_job_does_not_have_are_refused(no_leftovers):
    import ddp_notebook

    job = ddp_notebook.launch(_says_hello, cpus=2, background=True)
    job.wait(timeout=120)
    assert [job.logs(rank) for rank in (0, 1)] == ["hello from 0\n", "hello from 1\n"]
    assert job.logs(np.int64(1)) == "hello from 1\n"  # (a numpy integer is a rank too)
    for rank in (2, -1, "0", True):
        with pytest.raises(ValueError) as info:
            job.logs(rank)
        assert str(info.value) == f"job #{job.task_id} has ranks 0 to 1: no rank {rank!r}"


def test_a_rank_log_keeps_its_newest_16_mb(monkeypatch):
    monkeypatch.setattr(output, "LOG_BYTES_PER_RANK", 1000)
    relay = output.OutputRelay(io.StringIO(), io.StringIO())
    for i in range(500):
        relay.feed(1, "stdout", f"{i:05d}\n".encode())
    kept = relay.log(1)
    assert kept == "".join(f"{i:05d}\n" for i in range(334, 500))  # 996 bytes: whole lines only
    assert relay.log(0) == ""
