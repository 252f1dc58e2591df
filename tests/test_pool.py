"""Warm pools and background jobs in real kernels."""
import os
import re
import signal
import time

import psutil
import pytest

from nbrun import error, gone, kernel, run_cells, run_until_pids, text
from ddp_notebook.engine import pool
from ddp_notebook.notebook import cell_reading

pytestmark = pytest.mark.timeout(300)


def test_pool_unit_helpers():
    import torch

    assert cell_reading.names_assigned("import numpy as np, os.path\nx, (y, z) = 1, (2, 3)\nfor i in range(2): pass\n"
                               "def f(a):\n    b = 1\nclass C: pass\nwith open('f') as fh: pass") == \
        {"np", "os", "x", "y", "z", "i", "f", "C", "fh"}
    assert cell_reading.collective_calls("import torch.distributed as dist\ndist.all_reduce(t)\nm = DDP(net)\nprint(t)") \
        == ["DDP", "all_reduce"]
    assert cell_reading.collective_calls("print(t.sum())") == []
    big = torch.zeros(100_000)
    before = pool.fingerprint(big)
    assert pool.fingerprint(big) == before
    big[5] = 1  # mutated in place: a new fingerprint
    assert pool.fingerprint(big) != before
    items = [1, 2]
    mark = pool.fingerprint(items)
    items.append(3)
    assert pool.fingerprint(items) != mark


@pytest.mark.slow
@pytest.mark.kernel
def test_a_pool_keeps_state_across_cells_and_recovers_from_errors(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "%ddp_start --cpus 2",
        "import torch\nweights = torch.arange(200_000, dtype=torch.float64)\nitems = [1, 2]\ncalls = 0",
        # 3: five pool cells in a row keep state
        "%%ddp\nimport os\nimport torch.distributed as dist\nmodel = torch.nn.Linear(4, 4)\n"
        "pid = os.getpid()\ncounter = torch.zeros(1)\nprint('pid', pid)",
        "%%ddp\ncounter += 1\ndist.all_reduce(counter)\nprint('pid', os.getpid(), 'counter', counter.item())",
        "%%ddp\ncounter += 1\nprint('same model', isinstance(model, torch.nn.Linear), counter.item())",
        "%%ddp\nprint('sum', weights.sum().item(), 'items', len(items))",
        # 7: the notebook mutates names in place: the ranks see the change
        "items.append(3)\nweights[0] = 1e9",
        "%%ddp --return seen\nseen = (len(items), weights[0].item())\nprint('pid', os.getpid())",
        # 9: a name assigned in the ranks wins over the notebook's until the notebook rebinds it
        "%%ddp\ncalls = 100 + rank",
        "%%ddp --return calls\ncalls += 1",
        "print('calls', calls)",
        "print('seen', seen)\ncalls = -5",  # 12: the value cell 8 sent back
        "%%ddp --return calls\ncalls += 1",
        "print('calls', calls)",
        # 15: subset cells
        "%%ddp --ranks 0\nprint('inspect', counter.item(), rank)",
        "%%ddp --ranks 1\ndist.all_reduce(counter)",
        # 17: every rank fails alike: the pool stays (a NameError the magic's check cannot see coming)
        "%%ddp\nnot_defined_anywhere = 1\ndel not_defined_anywhere\nprint(not_defined_anywhere)",
        "%%ddp\nprint('kept', counter.item(), 'pid', os.getpid())",
        # 19: ranks diverge: the pool restarts and says so
        "%%ddp\nif rank == 1:\n    raise RuntimeError('rank one quits')\ndist.all_reduce(counter)",
        "%%ddp\nimport os\nprint('fresh', 'counter' in dir(), 'pid', os.getpid())",
        "%ddp_status",
        # 22: explicit devices start a fresh job beside the pool
        "%%ddp --cpus 3\nprint('fresh job of', world_size)",
        "%ddp_stop",
        "import ddp_notebook.engine.pool as p\nprint('pool after stop:', p.current())",
    ], timeout=240)
    c = nb.cells
    pids = set(re.findall(r"pid (\d+)", text(c[3])))
    assert len(pids) == 2
    assert "counter 2.0" in text(c[4]) and set(re.findall(r"pid (\d+)", text(c[4]))) == pids
    assert text(c[5]).count("same model True 3.0") == 2
    assert text(c[6]).count(f"sum {float(sum(range(200_000)))} items 2") == 2
    assert set(re.findall(r"pid (\d+)", text(c[8]))) == pids
    assert error(c[8]) is None and text(c[12]) == "seen (3, 1000000000.0)\n"  # the ranks saw cell 7's changes
    assert "calls 101" in text(c[11])  # the ranks' own `calls` (100 + rank 0), not the notebook's 0
    assert "calls -4" in text(c[14])  # the notebook rebound it: its value is shipped again
    assert text(c[15]) == "[rank 0] inspect 3.0 0\n"
    assert "a collective needs every rank and would hang" in text(c[16])
    assert "NameError" in text(c[17]) and "every rank failed the same way" in text(c[17])
    assert text(c[18]).count("kept 3.0") == 2 and set(re.findall(r"pid (\d+)", text(c[18]))) == pids
    assert "RuntimeError: rank one quits" in text(c[19])
    assert "the warm pool was restarted and the names its ranks held are gone" in text(c[19])
    fresh = set(re.findall(r"pid (\d+)", text(c[20])))
    assert text(c[20]).count("fresh False") == 2 and fresh and not fresh & pids
    assert "1 restarts" in text(c[21])
    assert text(c[22]).count("fresh job of 3") == 3
    assert "warm pool stopped" in text(c[23])
    assert "pool after stop: None" in text(c[24])
    for pid in pids | fresh:  # %ddp_stop left nothing, checked before the kernel shut down (cell 24 ran)
        assert not psutil.pid_exists(int(pid)) or psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.kernel
def test_seen_values_come_back_from_a_pool_cell(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "%ddp_start --cpus 2",
        "import torch\nw = torch.zeros(100_000)\nlog = []",
        "%%ddp --return total\ntotal = w.sum().item() + len(log)",
        "w[:] = 1\nlog.append('x')",
        "%%ddp --return total\ntotal = w.sum().item() + len(log)",
        "print(total)",
        # launch() without devices runs on the pool too
        "%%ddp --return pool_pid\nimport os\npool_pid = os.getpid()",
        "import os, ddp_notebook\ndef where():\n    import os\n    return os.getpid()\n"
        "pids = ddp_notebook.launch(where)\nprint(pids[0] == pool_pid, len(pids))",
        # 9: a cell that failed on every rank does not count what it would have bound as held
        "mdl = 'the notebook'",
        "%%ddp\nundefined_name = 1\ndel undefined_name\nprint(undefined_name)\nmdl = 1",
        "%%ddp --return got\ngot = mdl",
        "print(got)",
        "%%ddp --ranks 1 --return x\nx = 1",
        "%ddp_stop",
    ])
    assert text(nb.cells[6]) == "100001.0\n"
    assert text(nb.cells[8]) == "True 2\n"
    assert "NameError" in text(nb.cells[10])
    assert text(nb.cells[12]) == "the notebook\n"
    assert "--return copies names back from rank 0, which --ranks leaves out" in text(nb.cells[13])



@pytest.mark.slow
@pytest.mark.kernel
def test_pool_cells_compile_as_the_notebook_does_and_get_each_source_once(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "%ddp_start --cpus 2",
        "def boom(n):\n    if n > 0:\n        raise ValueError(f'boom {n}')\n",
        "%%ddp\nboom(1)",
        "%%ddp\nx = 1",
        "%%ddp\nx += 1",
        # 6: the ranks hold cell 2's source by now; its label and lines still show
        "%%ddp\nboom(7)",
        # 7: a function a %%ddp cell defined fails in a later cell: the line is shown as the user wrote it
        "%%ddp\ndef inverse(v):\n    return 1 / v\n",
        "%%ddp\ninverse(rank - rank)",
        "%%ddp\nx += 2",
        # 10: the earlier cells' sources are not sent again, only this cell's own
        "from ddp_notebook.engine import pool\nfrom ddp_notebook.wire import payload\n"
        "print(sorted(pool.current().sources_to_ship([0, 1])[0].labels.values()))",
        # 11: annotations are evaluated as in the notebook, with the notebook's __future__ features
        "%%ddp --return hints\ndef typed(a: int) -> float:\n    return a\nhints = typed.__annotations__",
        "print(hints)",
        "from __future__ import annotations",
        "%%ddp --return hints\ndef typed(a: int) -> float:\n    return a\nhints = typed.__annotations__",
        "print(hints)",
        # 16: a rank dies between cells: the fresh ranks get every name and source the cell needs (and keep the
        # sources though something clears linecache, as profilers and debuggers do)
        "import os, signal, time\nos.kill(pool.current().group.pids[1], signal.SIGKILL)\ntime.sleep(1)",
        "%%ddp\nimport linecache\nlinecache.clearcache()\nboom(5)",
        # 18-20: a %%ddp cell run again after another cell keeps its file (ipykernel names it by its code), so it
        # is not the newest one: its lines still show under its new number
        "%%ddp\ndef again():\n    raise KeyError('again')\nagain()",
        "z = 1",
        "%%ddp\ndef again():\n    raise KeyError('again')\nagain()",
        "%ddp_stop",
    ])
    c = nb.cells
    where = f'File "Cell In[{c[2].execution_count}]", line 3, in boom'
    for cell, value in ((c[3], "boom 1"), (c[6], "boom 7")):
        shown = text(cell)
        assert f"ValueError: {value}" in shown and where in shown and "raise ValueError(f'boom {n}')" in shown
    shown = text(c[8])
    assert f'File "Cell In[{c[7].execution_count}]", line 3, in inverse' in shown and "return 1 / v" in shown
    assert text(c[10]) == f"['Cell In[{c[10].execution_count}]']\n"
    assert text(c[12]) == "{'a': <class 'int'>, 'return': <class 'float'>}\n"
    assert text(c[15]) == "{'a': 'int', 'return': 'float'}\n"
    shown = text(c[17])
    assert "rank(s) 1 of the warm pool had died; the warm pool was restarted" in shown
    assert "ValueError: boom 5" in shown and where in shown and "raise ValueError(f'boom {n}')" in shown
    for cell in (c[18], c[20]):
        shown = text(cell)
        assert f'File "Cell In[{cell.execution_count}]", line 3, in again' in shown, shown
        assert f'File "Cell In[{cell.execution_count}]", line 4, in <module>' in shown, shown
        assert "raise KeyError('again')" in shown and "Cell In[1" not in shown.replace(f"In[{cell.execution_count}]", "")


TRAIN = '''%%ddp
import os, time
net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
for step in range(20):
    net(torch.randn(4, 16)).sum().backward()
print("PID", os.getpid(), flush=True)
while True:  # past the last collective: the interrupt finds no rank inside one, so the pool must keep its ranks
    time.sleep(0.01)'''


def _execute(kc, code, timeout=120):
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=lambda msg: _seen.append(msg))
    return reply


_seen: list = []


def _streams():
    return "".join(m["content"].get("text", "") for m in _seen if m["msg_type"] == "stream")


@pytest.mark.slow
@pytest.mark.kernel
def test_interrupt_in_a_pool_cell_and_kernel_death_leave_nothing(no_leftovers):
    with kernel("%load_ext ddp_notebook\nimport torch") as (km, kc):
        _execute(kc, "%ddp_start --cpus 2")
        _execute(kc, "%%ddp\nimport os\nkept = rank * 10\nprint('PID', os.getpid())")
        msg_id, pids = run_until_pids(kc, TRAIN)
        time.sleep(0.5)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        told = ""
        while True:  # what the interrupted cell said
            msg = kc.get_iopub_msg(timeout=30)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                told += msg["content"]["text"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        _seen.clear()
        _execute(kc, "%%ddp\nprint('after interrupt', 'kept' in dir() and kept, os.getpid())")
        after = _streams()
        # Interrupt stops the cell, not the pool: the same ranks, with the names bound before the interrupt.
        assert "the warm pool was restarted" not in told + after
        assert "the warm pool's ranks are back and keep their state" in told
        assert "after interrupt 0" in after and "after interrupt 10" in after
        assert set(map(int, re.findall(r"after interrupt \d+ (\d+)", after))) == pids
        assert _execute(kc, "print(1)")["content"]["status"] == "ok"
        _, pool_pids = run_until_pids(kc, "%%ddp\nimport os\nprint('PID', os.getpid())")
        kernel_pid = km.provisioner.process.pid
        os.kill(kernel_pid, signal.SIGKILL)
        assert gone(pool_pids, 10), "pool ranks outlived the kernel"


@pytest.mark.slow
@pytest.mark.kernel
def test_a_background_job_runs_while_other_cells_do(no_leftovers):
    nb, _ = run_cells([
        "%load_ext ddp_notebook",
        "%%ddp --cpus 2 --background --return last\nimport time\nfrom ddp_notebook import report\n"
        "for epoch in range(1, 9):\n    time.sleep(0.25)\n    report(epoch=epoch, epochs=8, loss=float(rank + epoch))\n"
        "last = epoch",
        "job = _\nprint('status', job.status)\nprint('meanwhile', 6 * 7)",
        "values = job.wait(timeout=120)\nprint('status', job.status, 'values', len(values))\n"
        "print('history', [round(r['loss'], 2) for r in job.history])\nprint('returned', last)",
        "%ddp_jobs",
        "%%ddp --cpus 2 --background\nimport time, os\nprint('PID', os.getpid(), flush=True)\ntime.sleep(600)",
        "import time\nslow = _\nt = time.time()\ntime.sleep(4)\nslow.stop()\nprint('stopped in', round(time.time() - t - 4, 1), slow.status)\n"
        "print('error', type(slow.error).__name__)",
    ], timeout=180)
    c = nb.cells
    assert "status running" in text(c[2]) and "meanwhile 42" in text(c[2])
    assert "status done values 2" in text(c[3])
    assert "history [1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5]" in text(c[3])
    assert "returned 8" in text(c[3])
    assert re.search(r"job #\d+: done", text(c[4]))
    stopped = re.search(r"stopped in ([\d.]+) stopped", text(c[6]))
    assert stopped and float(stopped.group(1)) < 5
    assert "error JobStopped" in text(c[6])
    # Its output and dashboard live in widgets under its own cell, never in the cells that ran meanwhile.
    assert "[rank" not in text(c[2]) + text(c[3])
    assert any(o.get("data", {}).get("application/vnd.jupyter.widget-view+json") for o in c[1].outputs)


def test_a_pool_cell_gets_only_the_cell_sources_its_ranks_miss_however_long_the_session(monkeypatch):
    # IPython's map of the cells it compiled only grows: what a pool's ranks miss is read from its newest end, so
    # a session's thousandth cell costs what its first did, and the full sources (fresh ranks) stay the same.
    import linecache
    import types

    import IPython

    from ddp_notebook.notebook.magic import _this_cell
    from ddp_notebook.wire import payload

    filename_map: dict[str, int] = {}
    shell = types.SimpleNamespace(compile=types.SimpleNamespace(_filename_map=filename_map), execution_count=0)
    monkeypatch.setattr(IPython, "get_ipython", lambda: shell)
    for name in ("_cells", "_cell_versions", "_written_texts"):
        monkeypatch.setattr(payload, name, type(getattr(payload, name))())
    monkeypatch.setattr(payload, "_version", 0)
    monkeypatch.setattr(payload, "_cells_counted", 0)

    def this_cell(filename: str):  # what the magic finds, called from the code of the cell in ``filename``
        found = {}
        exec(compile("found['cell'] = _this_cell(shell, '', 'f()\\n')", filename, "exec"),
             {"_this_cell": _this_cell, "shell": shell, "found": found})
        return found["cell"]

    def run_cell(text: str) -> str:  # as ipykernel names a cell's file: by its code (a cell run again keeps it)
        shell.execution_count += 1
        filename = f"/tmp/ipykernel_0/{abs(hash(text))}.py"
        linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
        filename_map[filename] = shell.execution_count
        return filename

    try:
        cells = [run_cell(f"x{n} = {n}\n") for n in range(1, 1001)]
        everything, version = payload.sources_since(0)
        assert len(everything.texts) == 1000 and everything.labels[cells[6]] == "Cell In[7]"
        assert everything.texts == payload.notebook_sources().texts
        assert payload.sources_since(version) == (payload.Sources(), version)  # nothing new
        f1001 = run_cell("def f():\n    return 1\n")
        f1002 = run_cell("get_ipython().run_cell_magic('ddp', '', 'f()\\n')\n")
        assert this_cell(f1002) == (f1002, 1002)
        payload.hold_cell_text(f1002, "%%ddp \nf()\n", "Cell In[1002]")  # the %%ddp cell as written
        new, newer = payload.sources_since(version)
        assert new.texts == {f1001: "def f():\n    return 1\n", f1002: "%%ddp \nf()\n"}
        assert new.labels == {f1001: "Cell In[1001]", f1002: "Cell In[1002]"}
        assert newer > version and payload.sources_since(newer)[0].texts == {}
        assert payload.notebook_sources().texts[f1002] == "%%ddp \nf()\n"
        # A new cell, then cell 7 and the %%ddp cell again (In[1004], In[1005]): the same files, with new numbers.
        w = run_cell("w0 = 0\n")
        assert run_cell("x7 = 7\n") == cells[6]
        assert run_cell("get_ipython().run_cell_magic('ddp', '', 'f()\\n')\n") == f1002
        assert this_cell(f1002) == (f1002, 1005)
        payload.hold_cell_text(f1002, "%%ddp \nf()\n", "Cell In[1005]")
        again, newest = payload.sources_since(newer)
        assert again.labels == {w: "Cell In[1003]", cells[6]: "Cell In[1004]", f1002: "Cell In[1005]"}
        # At most SOURCES_BUDGET of text a task: what does not fit goes with the next; a cell too big ever, never.
        monkeypatch.setattr(payload, "SOURCES_BUDGET", 40)
        small = [run_cell(f"y{n} = '{n:>10}'\n") for n in range(3)]  # 18 bytes each
        huge = run_cell("z = '" + "z" * 100 + "'\n")
        last = run_cell("w = 1\n")
        first, v1 = payload.sources_since(newest)
        second, v2 = payload.sources_since(v1)
        assert list(first.texts) == small[:2] and list(second.texts) == [small[2], last] and huge not in second.texts
        assert payload.sources_since(v2) == (payload.Sources(), v2)
    finally:
        for filename in filename_map:
            linecache.cache.pop(filename, None)
