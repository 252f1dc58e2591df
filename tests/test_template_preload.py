"""The rank template preloads the libraries the notebook imported, stays fit to fork, and never keeps a job waiting.

Real kernels (tests/nbrun.py), real ranks over gloo; the libraries are fake ones, installed (a module and its
dist-info) in a folder the kernel puts on its ``sys.path``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import fake_libraries
from ddp_notebook.engine import template
from nbrun import KEEP_DEBUG_LOG, execute, gone, kernel, run_cell, start_kernel

pytestmark = [pytest.mark.timeout(300), pytest.mark.kernel]

_LIBRARIES = {
    "ddpnb_fake_plain": '__version__ = "1.0"\n',
    "ddpnb_fake_thread": textwrap.dedent("""
        import threading, time
        __version__ = "1.0"
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    """),
    "ddpnb_fake_cuda": textwrap.dedent("""
        import torch
        __version__ = "1.0"
        if torch.cuda.is_available():
            torch.cuda.init()
        else:  # a CPU-only machine: what torch.cuda.init() leaves behind, which is what the template checks
            torch.cuda._initialized = True
    """),
    "ddpnb_fake_broken": textwrap.dedent("""
        import sys
        __version__ = "1.0"
        if "IPython" not in sys.modules:  # loads in a kernel, fails anywhere else
            raise ImportError("ddpnb_fake_broken needs IPython")
    """),
}


_MARK = textwrap.dedent("""
    import os as _os
    _os.makedirs(_os.path.join(_os.path.dirname(__file__), "marks"), exist_ok=True)
    with open(_os.path.join(_os.path.dirname(__file__), "marks", __name__), "a") as _mark:
        _mark.write(f"{_os.getpid()} ")
""")


def _install(folder, name: str, code: str, version: str = "1.0") -> None:
    """A module and the dist-info that makes it an installed library, as pip leaves them; every process that
    imports it adds its pid to ``marks/NAME`` beside it."""
    fake_libraries.install(folder, name, _MARK + code, version)


# In the kernel: every debug message of ddp_notebook kept in DEBUG_LOG, and settle(), which waits until the template
# is ready and has preloaded what the notebook imported, replacing every template a library tainted on the way.
_KERNEL_SETUP = KEEP_DEBUG_LOG + textwrap.dedent("""
    import json, logging, os, sys
    from ddp_notebook.engine import template as t

    def settle():
        while True:
            t.preload_notebook_libraries()  # as after a cell: a tainted template replaced, a ready one asked
            current = t.current()
            assert current.wait_ready()
            t.preload_notebook_libraries()
            assert current.wait_preloaded()
            if current.tainted is None:
                return current
            print("TAINTED", current.proc.pid, current.tainted)
""")

_RANK_SEES = textwrap.dedent("""
    %%ddp --cpus 2
    import json, os, sys, torch
    at_start = sorted(name for name in sys.modules if name.startswith("ddpnb_fake"))
    import ddpnb_fake_plain
    print("RANK " + json.dumps({"ppid": os.getppid(), "at_start": at_start, "version": ddpnb_fake_plain.__version__,
                                "file": ddpnb_fake_plain.__file__, "sys_path": sys.path,
                                "cuda": torch.cuda.is_initialized()}), flush=True)
""")


def _ranks(text: str) -> list[dict]:
    return [json.loads(line) for line in re.findall(r"RANK (\{.*\})", text)]


def _numbers(text: str, label: str) -> list[int]:
    return [int(n) for n in re.findall(label + r" (\d+)", text)]


def test_the_other_modules_of_what_ranks_set_up_themselves_are_never_asked_for(monkeypatch):
    """matplotlib is the ranks' to set up (MPLBACKEND); its distribution's other top-level modules import it
    (``mpl_toolkits.mplot3d``, ``pylab``): asked for, they tainted the template of every notebook that plots."""
    import mpl_toolkits.mplot3d  # noqa: F401

    monkeypatch.setattr(template, "_left_to_ranks", {})  # (not as an earlier template in this process left it)

    libraries = template.notebook_libraries()
    assert "numpy" in libraries  # (what is installed was read)
    assert not {"matplotlib", "mpl_toolkits", "pylab"} & set(libraries), libraries


def test_libraries_that_fail_start_a_thread_or_initialise_cuda_are_left_to_the_ranks(tmp_path, no_leftovers):
    for name, code in _LIBRARIES.items():
        _install(tmp_path, name, code)
    with kernel() as (km, kc):
        imports = ", ".join(_LIBRARIES)
        execute(kc, [_KERNEL_SETUP, f"sys.path.insert(0, {str(tmp_path)!r})\nimport {imports}"])
        said = execute(kc, ["current = settle()",
                            "print('TEMPLATE', current.proc.pid, current.preloaded)",
                            "print('LEFT ' + json.dumps(t.left_to_ranks()))",
                            "print('LOG ' + json.dumps(DEBUG_LOG))"])
        left = json.loads(re.search(r"LEFT (.*)", said).group(1))
        assert set(left) == {"ddpnb_fake_thread", "ddpnb_fake_cuda", "ddpnb_fake_broken"}
        assert left["ddpnb_fake_thread"] == "started 1 thread"
        assert left["ddpnb_fake_cuda"] == "initialised CUDA"
        assert left["ddpnb_fake_broken"] == "ImportError: ddpnb_fake_broken needs IPython"
        debug = json.loads(re.search(r"LOG (.*)", said).group(1))
        for name, why in left.items():
            assert f"rank template: {name} left to the ranks ({why})" in debug
        tainted = _numbers(said, "TAINTED")
        assert len(tainted) == 2 and all(not psutil.pid_exists(pid) for pid in tainted)  # each replaced, and gone
        (clean,) = _numbers(said, "TEMPLATE")
        assert clean not in tainted and "'ddpnb_fake_plain'" in said
        # Which processes imported which library (each leaves a mark): the tainted templates did, the clean one never.
        imported = {name: {int(pid) for pid in (tmp_path / "marks" / name).read_text().split()} for name in left}
        assert clean not in set().union(*imported.values())
        kernel_pid = km.provisioner.process.pid
        assert set(tainted) == (imported["ddpnb_fake_thread"] | imported["ddpnb_fake_cuda"]) - {kernel_pid}

        forked = _ranks(execute(kc, [_RANK_SEES]))
        assert [r["ppid"] for r in forked] == [clean, clean]
        for rank in forked:  # what was left to the ranks is not there at their start; CUDA untouched
            assert rank["at_start"] == ["ddpnb_fake_plain"] and rank["cuda"] is False


def test_preloaded_libraries_are_what_a_fresh_rank_imports_and_a_change_on_disk_means_a_new_template(
        tmp_path, no_leftovers):
    _install(tmp_path, "ddpnb_fake_plain", _LIBRARIES["ddpnb_fake_plain"])
    with kernel() as (km, kc):
        execute(kc, [_KERNEL_SETUP, f"sys.path.insert(0, {str(tmp_path)!r})\nimport ddpnb_fake_plain"])
        said = execute(kc, ["t.current().wait_ready()",  # the template asked to preload after this cell
                            "print('ASKED', 'ddpnb_fake_plain' in t.current().asked)",
                            "print('TEMPLATE', settle().proc.pid)"])
        assert "ASKED True" in said
        (first,) = _numbers(said, "TEMPLATE")
        forked = _ranks(execute(kc, [_RANK_SEES]))
        execute(kc, ["os.environ['DDP_NOTEBOOK_TEMPLATE'] = '0'"])
        fresh = _ranks(execute(kc, [_RANK_SEES]))
        execute(kc, ["del os.environ['DDP_NOTEBOOK_TEMPLATE']"])
        assert [r["ppid"] for r in forked] == [first, first]
        assert [r["ppid"] for r in fresh] == [km.provisioner.process.pid] * 2
        assert [r["at_start"] for r in forked] == [["ddpnb_fake_plain"]] * 2
        assert [r["at_start"] for r in fresh] == [[]] * 2
        different = {"ppid", "at_start"}
        assert [{k: v for k, v in r.items() if k not in different} for r in forked] == \
            [{k: v for k, v in r.items() if k not in different} for r in fresh]
        assert forked[0]["file"] == str(tmp_path / "ddpnb_fake_plain.py") and forked[0]["version"] == "1.0"

        # A new version on disk (the kernel still holds the old one): the ranks get the new one, from a new template.
        library = tmp_path / "ddpnb_fake_plain.py"
        library.write_text('__version__ = "2.0"\n')
        stat = library.stat()
        os.utime(library, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        upgraded = _ranks(execute(kc, [_RANK_SEES]))
        (second,) = _numbers(execute(kc, ["print('TEMPLATE', t.current_pid())"]), "TEMPLATE")
        assert second != first and not psutil.pid_exists(first)
        assert [(r["ppid"], r["version"]) for r in upgraded] == [(second, "2.0")] * 2
        said = execute(kc, ["print('REPLACED', any('ddpnb_fake_plain changed on disk' in m for m in DEBUG_LOG))"])
        assert "REPLACED True" in said


# A sitecustomize for the kernel's environment: in the rank template only, ``import torch`` waits until the test
# lets it go (a file appears), so that the template is certainly not ready while the background cell runs.
_HELD_TORCH_IN_THE_TEMPLATE = textwrap.dedent("""
    import importlib.abc, os, sys, time

    class HeldTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and "ddp_notebook.rank.template" in sys.orig_argv:
                while not os.path.exists(os.environ["DDP_NOTEBOOK_TEST_GO"]):
                    time.sleep(0.02)
            return None

    sys.meta_path.insert(0, HeldTorch())
""")

_BACKGROUND = textwrap.dedent("""
    %%ddp --background --cpus 2
    import os
    with open(os.path.join(FOLDER, os.environ["RANK"]), "w") as f:
        f.write(str(os.getppid()))
""")


def test_a_background_cell_returns_before_the_template_is_ready_and_its_ranks_are_forked_from_it_once_it_is(
        tmp_path, no_leftovers):
    (tmp_path / "sitecustomize.py").write_text(_HELD_TORCH_IN_THE_TEMPLATE)
    go, folder = tmp_path / "go", tmp_path / "parents"
    folder.mkdir()
    path = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), DDP_NOTEBOOK_TEST_GO=str(go))
    km, kc = start_kernel(env)
    template_pid = None
    try:
        execute(kc, ["%load_ext ddp_notebook", f"import ddp_notebook, os\nFOLDER = {str(folder)!r}\n"
                     "from ddp_notebook.engine import template as t"])
        reply, said = run_cell(kc, _BACKGROUND)
        assert reply["status"] == "ok", said
        # The cell has returned, and the next one runs, while the template is still held in its import of torch:
        # no rank has started (none started fresh beside it).
        said = execute(kc, ["print('READY', t.current().wait_ready(timeout=0), 'TEMPLATE', t.current_pid(), "
                            "'PIDS', len(ddp_notebook.last_job().pids), 'WROTE', len(os.listdir(FOLDER)))"])
        assert "READY False" in said and "PIDS 0 WROTE 0" in said, said
        (template_pid,) = _numbers(said, "TEMPLATE")
        go.write_text("")
        said = execute(kc, ["ddp_notebook.last_job().wait(timeout=120)\n"
                            "print('DONE', ddp_notebook.last_job().status, 'TEMPLATE', t.current_pid())"])
        assert f"DONE done TEMPLATE {template_pid}" in said, said
        parents = {int((folder / rank).read_text()) for rank in ("0", "1")}
        assert parents == {template_pid}  # forked from it once it was ready
        said = execute(kc, [_PARENTS])
        assert set(_numbers(said, "PARENT")) == {template_pid}  # and the next job too
    finally:
        go.write_text("")
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        if template_pid is not None:
            assert gone([template_pid], within=10)


_PARENTS = "%%ddp --cpus 2\nimport os\nprint('PARENT', os.getppid(), flush=True)"


def test_what_the_template_preloads_is_installed_libraries_beyond_the_stdlib_jupyter_and_what_ranks_set_up(tmp_path):
    # In a process of its own: in the suite's, what earlier tests' templates left to the ranks is left out too.
    _install(tmp_path, "ddpnb_fake_plain", "")
    said = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json, sys
        import IPython, jupyter_client, pygments, jedi, psutil  # (IPython 9 requires psutil: Jupyter's own then)
        import ddpnb_fake_plain
        from ddp_notebook.engine import template
        print(json.dumps(template.notebook_libraries()))
    """)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    wanted = json.loads(said.stdout.splitlines()[-1])
    assert "ddpnb_fake_plain" in wanted
    for name in ("json", "IPython", "matplotlib", "jupyter_client", "zmq", "traitlets", "pygments", "jedi",
                 "ddp_notebook", "sys"):
        assert name not in wanted
    assert all(not name.startswith("_") for name in wanted)


# A library whose import in the rank template waits until the test lets it go (a file appears); anywhere else it
# imports at once.
_HELD_IN_THE_TEMPLATE = textwrap.dedent("""
    import os, sys, time
    __version__ = "1.0"
    if "ddp_notebook.rank.template" in sys.orig_argv:
        go = os.path.join(os.path.dirname(__file__), "go")
        deadline = time.monotonic() + 250
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.02)
""")


def _exits_and_pid():
    import os

    return os.getppid()


def test_a_job_ends_while_the_template_is_still_importing_a_library(tmp_path, monkeypatch, caplog, no_leftovers):
    _install(tmp_path, "ddpnb_fake_held", _HELD_IN_THE_TEMPLATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import ddp_notebook

    import ddpnb_fake_held  # noqa: F401  the notebook has imported it: the template is asked for it after the forks
    assert "ddpnb_fake_held" in template.notebook_libraries()  # (known installed, as a cell's end would have read)

    template.stop()
    started = template.ready_template()
    assert started.wait_preloaded()  # torch._dynamo: done
    try:
        with caplog.at_level(logging.DEBUG, logger="ddp_notebook"):
            parents = ddp_notebook.launch(_exits_and_pid, cpus=2)
        # The job has ended, each rank's exit code reported by the template, while the template still imports.
        assert parents == [started.proc.pid] * 2
        assert {"rank 0 exited with 0", "rank 1 exited with 0"} <= {r.getMessage() for r in caplog.records}
        assert "ddpnb_fake_held" in started.asked and "ddpnb_fake_held" not in started.preloaded
        assert not started.wait_preloaded(timeout=0)
    finally:
        (tmp_path / "go").write_text("")
    assert started.wait_preloaded() and "ddpnb_fake_held" in started.preloaded
    template.stop()
    sys.modules.pop("ddpnb_fake_held", None)


def _until_held_by_another_thread(lock, for_s: float = 0.5) -> None:
    """Until another thread has held ``lock`` for ``for_s`` seconds on end."""
    held_since, deadline = None, time.monotonic() + 60
    while time.monotonic() < deadline:
        if lock.acquire(blocking=False):
            lock.release()
            held_since = None
        elif held_since is None:
            held_since = time.monotonic()
        elif time.monotonic() - held_since >= for_s:
            return
        time.sleep(0.01)
    raise AssertionError("no other thread held the lock")


def test_as_the_template_imports_a_library_a_background_job_starts_fresh_and_a_job_forking_holds_up_no_cell_s_end(
        tmp_path, monkeypatch, no_leftovers):
    """A library of the notebook's may take seconds to import, which fresh ranks need not wait for: a background job
    that comes meanwhile starts its ranks fresh (its cell returns at once).  A job that forks from the template
    waits for that import to end, and a cell that ends meanwhile must not wait with it."""
    _install(tmp_path, "ddpnb_fake_held", _HELD_IN_THE_TEMPLATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import ddp_notebook

    template.stop()
    started = template.ready_template()
    assert started.wait_preloaded()  # torch._dynamo: done
    import ddpnb_fake_held  # noqa: F401  a cell imports it ...
    forked = []
    try:
        template.preload_notebook_libraries()  # ... and at its end the template is asked for it: held there
        assert "ddpnb_fake_held" in started.asked
        marks = tmp_path / "marks" / "ddpnb_fake_held"
        while str(started.proc.pid) not in (marks.read_text().split() if marks.exists() else []):
            time.sleep(0.01)  # (until the template is in that import: a fork request waits for its end)
        background = ddp_notebook.launch(_exits_and_pid, cpus=2, background=True)
        assert background.wait(timeout=120) == [os.getpid()] * 2  # fresh, while the template still imports
        assert not started.wait_preloaded(timeout=0)
        # A job that forks from it (a foreground job of another thread) waits for the import's end ...
        job = threading.Thread(target=lambda: forked.extend(ddp_notebook.launch(_exits_and_pid, cpus=2)))
        job.start()
        _until_held_by_another_thread(started.forking)  # (its fork request)
        # ... and a cell's end meanwhile does not.
        cell_end = threading.Thread(target=template.preload_notebook_libraries)
        cell_end.start()
        cell_end.join(timeout=10)
        assert not cell_end.is_alive()
        assert job.is_alive() and not forked
    finally:
        (tmp_path / "go").write_text("")
    job.join(timeout=120)
    assert forked == [started.proc.pid] * 2  # forked from the template once its import was done
    template.stop()
    sys.modules.pop("ddpnb_fake_held", None)


def test_a_library_a_job_could_not_name_as_it_started_is_preloaded_at_the_cell_s_end(tmp_path, monkeypatch,
                                                                                     no_leftovers):
    """A job's forks ask the template for what the notebook imported without reading what is installed (0.2 s); when
    that was not read yet (the extension's thread reads it, late on a busy machine), the cell's end must still ask.
    It did not: the forks had noted that nothing was imported since, and the library was never preloaded."""
    _install(tmp_path, "ddpnb_fake_late", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    import ddp_notebook

    template.stop()
    started = template.ready_template()
    assert started.wait_preloaded()  # torch._dynamo: done
    import ddpnb_fake_late  # noqa: F401  a cell imports it, and runs a job
    template._distributions.cache_clear()  # what is installed, not read yet
    try:
        assert ddp_notebook.launch(_exits_and_pid, cpus=2) == [started.proc.pid] * 2
        assert "ddpnb_fake_late" not in started.asked  # (the forks could not name it)
        template.preload_notebook_libraries()  # the cell ends (IPython's post_run_cell)
        assert "ddpnb_fake_late" in started.asked
    finally:
        template.stop()
        sys.modules.pop("ddpnb_fake_late", None)
