"""What the magic checks before any rank starts: flags with spaces, names defined nowhere, missing loggers;
and how background jobs are listed and stopped.  The kernel tests run in real Jupyter kernels."""
import os
import re

import pytest

from ddp_notebook.notebook.cell_reading import undefined_names
from ddp_notebook.notebook.magic import DDPMagics, parse_flags
from nbrun import error, run_cell, run_cells, text

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("spaced, plain", [
    ("--cpus 2 --return m, opt", "--cpus 2 --return m,opt"),
    ("--return m , opt ,x --seed 1", "--return m,opt,x --seed 1"),
    ("--gpus 0, 1", "--gpus 0,1"),
    ("--gpus=0, 1 --background", "--gpus=0,1 --background"),
    ("--gpus 3, --seed 2", "--gpus 3, --seed 2"),  # one index with its trailing comma, then a flag
    ("--ranks 0, 1", "--ranks 0,1"),
    ("--ranks 0, 1, 2 --return a, b", "--ranks 0,1,2 --return a,b"),
])
def test_lists_parse_the_same_with_spaces_after_commas(spaced, plain):
    assert parse_flags(DDPMagics.ddp, spaced) == parse_flags(DDPMagics.ddp, plain)
    if spaced == "--gpus 0, 1":  # %ddp_start takes it too
        assert parse_flags(DDPMagics.ddp_start, spaced) == parse_flags(DDPMagics.ddp_start, plain)


def test_undefined_names_leave_out_everything_the_cell_or_notebook_defines():
    cell = '''import os, torch.nn as nn
from somewhere import y as z
for i, (a, b) in enumerate([]):
    pass
with open("f") as fh:
    pass
try:
    pass
except ValueError as err:
    pass
if (w := 3):
    pass
def f(p, *args, q=1, **kw) -> NotEvaluated:
    global g
    g = 1
    return [k for k in p] + [missing_in_f]
class Unused(Base):
    def m(self):
        return never_run
def unused():
    return defined_in_a_later_cell
v: AnnotationOnly = [s for s in range(3)]
del d
print(report(i), rank, local_rank, world_size, device, err, nn, os, z, y, notebook_name, f(1), __name__, len)'''
    assert undefined_names(cell, {"notebook_name": 1}) == {"missing_in_f": 16, "Base": 17, "report": 24, "y": 24}
    # Names bound where no reading can tell: nothing is refused.
    assert undefined_names("exec('x = 1')\nprint(x)", {}) == {}
    assert undefined_names("globals()['x'] = 1\nprint(x)", {}) == {}
    assert undefined_names("from somewhere import *\nprint(x)", {}) == {}
    # A decorated function may be registered and called elsewhere: its body counts.
    assert undefined_names("@register\ndef f():\n    return h\n", {"register": 1}) == {"h": 3}


@pytest.mark.slow
@pytest.mark.kernel
def test_cells_reading_undefined_names_are_refused_at_export_and_launch(tmp_path, no_leftovers):
    exported = tmp_path / "train.py"
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        f"%%ddp --export {exported}\nfor epoch in range(2):\n    report(epoch=epoch, loss=1.0)",
        "%%ddp --cpus 2\nimport os\nprint('PID', os.getpid())\nreport(epoch=1, loss=1.0)",
        "rank = \"the notebook's rank\"",
        # Nothing here is undefined; the spaced --return works; the notebook's `rank` is shadowed (line 9).
        "%%ddp --cpus 2 --return m, opt\nimport torch\nfrom ddp_notebook import report\n"
        "m = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "def later():\n    return defined_in_a_later_cell\nfor epoch in range(2):\n"
        "    report(epoch=epoch, loss=float(rank))\nprint('ran on', rank, 'of', world_size)",
        "print(type(m).__name__, type(opt).__name__)",
        f"%%ddp --export {tmp_path / 'good.py'}\nfrom ddp_notebook import report\nreport(epoch=1, loss=1.0)",
        "n = 2\nonly = '--output 0'",
        # IPython's $name and {expression} in the flags (the magic expands them itself)
        "%%ddp --cpus $n --seed {n + 5} $only\nimport random\nprint('drew', world_size, random.random())",
    ], cwd=str(tmp_path))
    c = nb.cells
    refused_export, refused_launch = text(c[1]), text(c[2])
    assert "UsageError: the cell reads report (line 3), which nothing defines" in refused_export
    assert "Nothing was exported" in refused_export and not [p for p in os.listdir(tmp_path) if "train" in p]
    assert "UsageError: the cell reads report (line 4), which nothing defines" in refused_launch
    assert "No rank was started" in refused_launch and "[rank" not in refused_launch
    ran = text(c[4])
    assert error(c[4]) is None, ran
    assert "[rank 0] ran on 0 of 2" in ran and "[rank 1] ran on 1 of 2" in ran
    # The shadowing warning points at the cell's line, not at IPython's source.
    assert f"Cell In[{c[4].execution_count}]:9: UserWarning: in %%ddp cells 'rank' is the rank's own" in ran
    assert "IPython" not in ran and ".py:" not in ran
    assert text(c[5]) == "Linear SGD\n"
    assert error(c[6]) is None and (tmp_path / "good.py").exists()
    import random

    random.seed(7)
    assert text(c[8]) == f"[rank 0] drew 2 {random.random()}\n"  # 2 ranks, seed 7, rank 0's output only


@pytest.mark.slow
@pytest.mark.kernel
def test_missing_loggers_are_refused_before_any_rank_starts(tmp_path, no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "import sys\nsys.modules['tensorboard'] = None\nsys.modules['wandb'] = None  # as if not installed",
        f"%%ddp --cpus 2 --tensorboard {tmp_path / 'tb'}\nimport os\nprint('PID', os.getpid())",
        "%%ddp --cpus 2 --callback wandb\nimport os\nprint('PID', os.getpid())",
        "import ddp_notebook, os\ndef f():\n    print('PID', os.getpid())\n"
        "try:\n    ddp_notebook.launch(f, cpus=2, callbacks=['wandb'])\n"
        "except ddp_notebook.LaunchError as exc:\n    print('refused:', exc)",
    ])
    c = nb.cells
    assert re.match(r"UsageError: TensorBoard logging .* cannot import: pip install tensorboard", text(c[2]))
    assert re.match(r"UsageError: Weights & Biases logging .* cannot import: pip install wandb", text(c[3]))
    assert re.match(r"refused: .*pip install wandb", text(c[4]))
    for refused in c[2:5]:
        assert "PID" not in text(refused)


@pytest.mark.slow
@pytest.mark.kernel
def test_background_launches_are_listed_and_a_stopped_job_says_so(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "import ddp_notebook\ndef sleepy():\n    import time\n    time.sleep(600)\n"
        "job = ddp_notebook.launch(sleepy, cpus=2, background=True)",
        "%ddp_jobs",
        "job.stop()\ntry:\n    job.wait()\nexcept Exception as exc:\n    print('caught', type(exc).__name__ + ':', exc)\n"
        "print('status', job.status, type(job.error).__name__,\n"
        "      isinstance(job.error, ddp_notebook.DDPNotebookError))",
        "%ddp_jobs",
    ])
    c = nb.cells
    assert re.fullmatch(r"job #\d+: running, 2 ranks, \d+ s\n", text(c[2]))
    assert re.search(r"caught JobStopped: job #\d+ was stopped by job.stop\(\) before it ended", text(c[3]))
    assert "status stopped JobStopped True" in text(c[3])
    assert re.fullmatch(r"job #\d+: stopped, 2 ranks, \d+ s\n", text(c[4]))


@pytest.mark.slow
@pytest.mark.kernel
def test_return_names_the_ranks_that_assigned_help_of_the_line_form_and_builtin_callbacks(no_leftovers):
    from nbrun import kernel

    with kernel() as (km, kc):
        # %ddp? shows the same help as %%ddp? (IPython pages it: the reply's payload)
        helps = []
        for asked in "%ddp?", "%%ddp?":
            reply = kc.execute_interactive(asked, timeout=60, output_hook=lambda msg: None)["content"]
            assert reply["status"] == "ok", reply
            helps.append(reply["payload"][0]["data"]["text/plain"])
        assert "Run this cell on every rank of a DDP job" in helps[0] and "--return <a,b>" in helps[0]
        assert "Object '%ddp' not found" not in helps[0]
        assert helps[0].split("File:")[0] == helps[1].split("File:")[0]
        reply, told = run_cell(kc, "%ddp --cpus 2")
        assert reply["status"] == "error" and "UsageError: %%ddp runs the cell below its line: write %%ddp --cpus 2 " \
                                              "as the cell's first line, with two % (%ddp? shows" in told, told
        reply, told = run_cell(kc, "%ddp --cpus 2 --seed 777 print(rank, 'x y')")  # flags and code on one line
        assert reply["status"] == "error" and "UsageError: %%ddp runs the cell below its line: write %%ddp --cpus 2 " \
                                              "--seed 777 as the cell's first line, with two %, and print(rank, 'x y') " \
                                              "below it (%ddp? shows its flags)" in told, told
        reply, told = run_cell(kc, "%ddp --seed abc print(1)")  # a flag that does not parse is no code
        assert reply["status"] == "error" and "UsageError: %%ddp runs the cell below its line: write %%ddp --seed abc " \
                                              "print(1) as the cell's first line, with two % (%ddp? shows" in told, told

        # a --return name the cell never binds: refused before any rank starts, naming it
        reply, told = run_cell(kc, "%%ddp --cpus 2 --return x,nothere\nimport os\nx = os.getpid()\n"
                                   "for i, (a, b) in enumerate([(1, 2)]):\n    pass\nprint('PRINTED')")
        assert reply["status"] == "error" and "[rank " not in told and "PRINTED" not in told
        assert "UsageError: --return nothere: the cell never assigns it" in told, told
        reply, told = run_cell(kc, "import ddp_notebook\nprint(ddp_notebook.last_job())")
        assert told == "None\n"
        # ... names a cell binds in any way are not refused: a rank's own, import, for and with targets, walrus
        reply, told = run_cell(kc, "%%ddp --cpus 2 --return rank,os,i,b,f,w,n\nimport os, contextlib\nfor i, (a, b) in "
                                   "[(1, (2, 3))]:\n    pass\nwith contextlib.nullcontext(7) as f:\n    pass\n"
                                   "if (w := 5):\n    n = None")
        assert reply["status"] == "ok", told
        assert run_cell(kc, "print(rank, os.__name__, i, b, f, w, n)")[1] == "0 os 1 3 7 5 None\n"

        # a name only rank 1 assigned: which rank's values --return copies, and which ranks assigned it
        reply, told = run_cell(kc, "%%ddp --cpus 2 --return x,y\nx = rank\nif rank == 1:\n    y = 'one'")
        assert "UsageError: --return: y was assigned on rank 1 but not on rank 0, whose values --return copies " \
               "(assign it on rank 0 too, or send it there: torch.distributed.broadcast_object_list); x copied " \
               "back" in told, told

        # --callback takes a builtin: print gets each reduced record in the notebook
        reply, told = run_cell(kc, "%%ddp --cpus 2 --callback print\nfrom ddp_notebook import report\n"
                                   "report(step=1, loss=float(rank))")
        assert reply["status"] == "ok", told
        assert "{'step': 1, 'loss': 0.5}" in told, told

        # on a warm pool, a name an earlier cell left on the ranks can be returned; one nothing bound cannot
        run_cell(kc, "%ddp_start --cpus 2")
        try:
            assert run_cell(kc, "%%ddp\nkept = rank + 40")[0]["status"] == "ok"
            reply, told = run_cell(kc, "%%ddp --return kept\npass")
            assert reply["status"] == "ok", told
            assert run_cell(kc, "print(kept)")[1] == "40\n"
            reply, told = run_cell(kc, "%%ddp --return never_bound\npass")
            assert "UsageError: --return never_bound: the cell never assigns it (no assignment, import, def, class, " \
                   "for or with target, := or global of it anywhere in it), nor do the warm pool's ranks hold it, " \
                   "so no rank could return it. No rank was started." in told, told
        finally:
            run_cell(kc, "%ddp_stop")
