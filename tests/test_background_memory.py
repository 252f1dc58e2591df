"""A finished background job keeps what it came to, not what ran it: a day of background jobs does not grow the kernel.

A background job is the cell's value (``Out[n]``), so the notebook refers to it for as long as the kernel lives.  Each
used to keep its whole dashboard (a matplotlib figure, the last PNG, the Stop button's widgets) and the cell's names
and pickled task: about 0.7 MiB a job.  Measured in a real kernel with tracemalloc, after warm-up: what each finished
job retains stays under ``BOUND_PER_JOB``, while ``%ddp_jobs`` lists every job and its results, history and error stay
reachable.
"""
import json
import time

import psutil

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
            "views": sum(isinstance(o, DisplayView) for o in gc.get_objects()),
            "figures": [sum(isinstance(o, kind) for o in gc.get_objects()) for kind in (Plot, matplotlib.figure.Figure)],
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
    # At most the one live figure the kernel keeps for the next job's dashboard.
    assert all(count <= 1 for count in probe["figures"]), probe
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


# -- descriptors and the kernel's memory, read from outside ------------------------------------------------------
# ipykernel gives each thread that prints or publishes a socket of its own (an eventfd) and closes those of ended
# threads only every 10 s; the job closes its threads' at their end.  Within this deadline of a job's end, the
# kernel's descriptors are back where they were: the kernel's own clean-up would come within it only once in five.
FDS_BACK_WITHIN_S = 2.0
REPORTS_A_WHILE = """
def reports_a_while(steps=6):
    import time
    for step in range(steps):
        ddp_notebook.report(step=step, steps=steps, loss=1.0 / (step + 1))
        time.sleep(0.15)
    print("reported", steps)
    return steps
"""
# A background cell that prints and reports for long enough that its dashboard's thread updates it too.
LONGER = "%%ddp --background --return x\nx = reports_a_while()"
LAUNCHED = "job = ddp_notebook.launch(reports_a_while, cpus=2, background=True)\nprint(job.join(timeout=60))"
LAUNCHED_SHORT = "job = ddp_notebook.launch(reports_a_while, (1,), cpus=2, background=True)\nprint(job.join(timeout=60))"
FOREGROUND = "%%ddp\nreports_a_while()"
FOREGROUND_LAUNCH = "print(ddp_notebook.launch(reports_a_while, cpus=2))"


def _kernel_pid(kc) -> int:
    return int(_run(kc, "import os\nprint(os.getpid())"))


def _fds_back(process, baseline: int) -> tuple[bool, int]:
    """(back at ``baseline`` within FDS_BACK_WITHIN_S, the count then)."""
    deadline = time.monotonic() + FDS_BACK_WITHIN_S
    while True:
        count = process.num_fds()
        if count <= baseline or time.monotonic() > deadline:
            return count <= baseline, count
        time.sleep(0.02)


def test_each_job_gives_back_the_kernels_descriptors_at_its_end_without_the_collector(no_leftovers):
    with kernel("") as (_km, kc):
        process = psutil.Process(_kernel_pid(kc))
        _run(kc, SETUP + REPORTS_A_WHILE)
        _run(kc, "%ddp_start --cpus 2")
        for cell in (REPORTS, LONGER, FOREGROUND, FOREGROUND_LAUNCH):  # warm-up: imports, caches, the template
            _run(kc, "i = 0")
            _run(kc, cell)
            _run(kc, f"print({WAIT})")
        _run(kc, LAUNCHED)
        _run(kc, "gc.collect()\ngc.disable()")  # from here on only what the jobs close themselves is closed
        time.sleep(FDS_BACK_WITHIN_S)
        baseline = process.num_fds()
        kinds = [("background cell", REPORTS), ("background cell with a dashboard", LONGER),
                 ("background launch()", LAUNCHED), ("background launch(), short", LAUNCHED_SHORT),
                 ("foreground cell", FOREGROUND), ("foreground launch()", FOREGROUND_LAUNCH)]
        left = []
        for round_ in range(3):
            for name, cell in kinds:
                _run(kc, f"i = {round_}")
                said = _run(kc, cell)
                if cell in (REPORTS, LONGER):
                    said = _run(kc, f"print({WAIT})")
                assert "True" in said or "reported" in said or "[6, 6]" in said, (name, said)
                back, count = _fds_back(process, baseline)
                if not back:
                    left.append(f"round {round_}, {name}: {count - baseline} more")
        still_off = _run(kc, "print(gc.isenabled(), len(get_ipython().kernel.iopub_thread._event_pipes))")
        _run(kc, "gc.enable()\n%ddp_stop")
    assert left == [], f"descriptors the kernel still held {FDS_BACK_WITHIN_S} s after the job's end: {left}"
    assert still_off.split()[0] == "False"


# 60 background cells after warm-up (each prints and draws its dashboard) grew the kernel by 16-22 MiB (PSS) while their threads'
# freed heap pages stayed mapped, 62 MiB while each kept its dashboard; now 3-9 MiB here, what each finished job keeps
# (about 40 KiB) and IPython's own per-cell cost included.
PSS_BOUND_60_JOBS = 12 << 20
JOBS = 60
PRINTS = REPORTS + "print('epoch 1 of job', i, 'on rank', rank)\n"  # its log under the cell, from the job's thread


@pytest.mark.timeout(900)
def test_sixty_background_jobs_leave_the_kernels_memory_bounded(no_leftovers):
    ran = []
    with kernel("") as (_km, kc):
        process = psutil.Process(_kernel_pid(kc))
        _run(kc, SETUP)
        _run(kc, "%ddp_start --cpus 2")
        for i in range(2 * WARM_UP):
            _background_job(kc, ran, PRINTS, i)
        _run(kc, "gc.collect()")
        before = process.memory_full_info().pss
        for i in range(JOBS):
            _background_job(kc, ran, PRINTS, i)
        grown = process.memory_full_info().pss - before
        listed = _run(kc, "%ddp_jobs")
        _run(kc, "%ddp_stop")
    assert listed.count(": done, 2 ranks") == len(ran), listed[-2000:]  # every job's status and results stay
    assert grown < PSS_BOUND_60_JOBS, \
        f"{JOBS} background jobs grew the kernel by {grown / 2**20:.1f} MiB (bound {PSS_BOUND_60_JOBS >> 20} MiB)"
