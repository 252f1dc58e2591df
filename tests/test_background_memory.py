"""A finished background job keeps what it came to, not what ran it: a day of background jobs does not grow the kernel.

A background job is the cell's value (``Out[n]``), so the notebook refers to it for as long as the kernel lives.  Each
used to keep its whole dashboard (a matplotlib figure, the last PNG, the Stop button's widgets) and the cell's names
and pickled task: about 0.7 MiB a job.  Measured in a real kernel with tracemalloc, after warm-up: what each finished
job retains stays under ``BOUND_PER_JOB``, while ``%ddp_jobs`` lists every job and its results, history and error stay
reachable.
"""
import json

import pytest

from nbrun import kernel

pytestmark = [pytest.mark.slow, pytest.mark.kernel, pytest.mark.timeout(300)]

# About 37 KiB a job here: the Job, its watcher's status and curves, its history and rank output tail, the finished
# thread, IPython's cells, and what matplotlib's bounded text caches still add; a dashboard kept whole was ~700 KiB.
BOUND_PER_JOB = 64 << 10
WARM_UP = 4

SETUP = """
%load_ext ddp_notebook
import gc, json, tracemalloc, weakref
import ddp_notebook

class Blob:
    pass

def probe():
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    import ipywidgets, matplotlib.figure
    from ddp_notebook.engine.job import background_jobs
    from ddp_notebook.notebook.dashboard import DisplayView, Plot
    jobs = background_jobs()
    return {"retained": retained, "blob_alive": blob_ref() is not None,
            "views": sum(isinstance(o, (DisplayView, Plot, matplotlib.figure.Figure)) for o in gc.get_objects()),
            "open_widgets": sum(isinstance(o, ipywidgets.Widget) and o.comm is not None for o in gc.get_objects()),
            "jobs": [[job.status, len(job.history)] for job in jobs],
            "returned": [job.results[0].values.get("x") for job in jobs if job.results],
            "errors": [type(job.error).__name__ for job in jobs if job.error is not None],
            "logs": sorted({type(job.logs(0)).__name__ for job in jobs})}
"""
# The same cell text every time (what changes is the notebook's i, shipped anew): the magic's caches of a cell's
# syntax tree and names hold 16 cells, which would grow through the measured jobs.
REPORTS = """%%ddp --background --return x
x = i * 10 + rank
ddp_notebook.report(epoch=1, epochs=1, loss=1.0 / (i + 1))
"""
FAILS = "%%ddp --background\nraise ValueError('on purpose')"
READS_BLOB = "%%ddp --background\nassert len(blob.data) == 4 << 20"
WAIT = "ddp_notebook.last_job().join(timeout=60)"


def _run(kc, code: str) -> str:
    said = []

    def collect(msg):
        if msg["msg_type"] == "stream":
            said.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            said.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "display_data":
            said.append(f"<display {' '.join(sorted(msg['content']['data']))}>")

    reply = kc.execute_interactive(code, timeout=120, output_hook=collect, stop_on_error=False)
    assert reply["content"]["status"] == "ok", (code, "".join(said))
    return "".join(said)


def _background_job(kc, ran: list, cell: str, i: int | None = None) -> None:
    """Run a background job's cell (with the notebook's ``i`` set first) and wait for the job."""
    if i is not None:
        _run(kc, f"i = {i}")
    _run(kc, cell)
    assert _run(kc, f"print({WAIT})").strip() == "True"
    ran.append((cell, i))


def test_finished_background_jobs_let_go_of_their_dashboards_and_payloads(no_leftovers):
    ran = []
    with kernel("") as (_km, kc):
        _run(kc, SETUP)
        _run(kc, "%ddp_start --cpus 2")
        # Warm-up (imports, matplotlib's font and text caches, the first failure's), and a job that reads a notebook
        # value: the notebook lets go of it, and so must the finished job.
        _run(kc, "blob = Blob()\nblob.data = bytes(4 << 20)\nblob_ref = weakref.ref(blob)")
        for i in range(WARM_UP):
            _background_job(kc, ran, REPORTS, i)
        _background_job(kc, ran, READS_BLOB)
        _background_job(kc, ran, FAILS)
        _run(kc, "del blob")
        _run(kc, "gc.collect()\ntracemalloc.start()")
        measured = [REPORTS] * 3 + [FAILS] + [REPORTS] * 3 + [FAILS]
        for i, cell in enumerate(measured, start=WARM_UP):
            _background_job(kc, ran, cell, i)
        listed = _run(kc, "%ddp_jobs")
        probe = json.loads(_run(kc, "print(json.dumps(probe()))"))
        redrawn = _run(kc, "from ddp_notebook.engine.job import background_jobs\nbackground_jobs()[-2].show()")
        _run(kc, "%ddp_stop")
    assert probe["views"] == 0 and probe["open_widgets"] == 0, probe
    assert not probe["blob_alive"], "a finished job keeps a notebook value it shipped after the notebook let go of it"
    per_job = probe["retained"] / len(measured)
    assert per_job < BOUND_PER_JOB, \
        f"each finished background job retains {per_job / 1024:.0f} KiB (bound {BOUND_PER_JOB >> 10} KiB)"
    # What a finished job came to stays: %ddp_jobs lists each, with its status, history, results and error.
    assert probe["jobs"] == [["failed", 0] if cell is FAILS else ["done", int(cell is REPORTS)] for cell, _ in ran]
    assert probe["returned"] == [i * 10 if cell is REPORTS else None for cell, i in ran if cell is not FAILS]
    assert probe["errors"] == ["RankError"] * 3
    assert probe["logs"] == ["str"]  # job.logs(rank) of a %%ddp --background job (its cell's log had hidden it)
    assert redrawn == "<display image/png text/plain>"  # show(): the dashboard drawn again from the history
    failed = sum(cell is FAILS for cell, _ in ran)
    assert listed.count(": done, 2 ranks") == len(ran) - failed and listed.count(": failed, 2 ranks") == failed, listed
