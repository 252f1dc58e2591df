"""A change to the kernel's environment never silently costs fresh ranks, and ranks always see the environment of now.

The rule (engine/template.py): a variable the template read as it imported (looked up by Python code, which the
template records; or read by native code as it loads, by name) makes a new template, started at once in the
background; any other change is applied in the forked rank.  Real templates, real ranks over gloo; a real kernel
for the notebook's libraries, and a getenv interposer (built here with gcc) for what native code reads.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import ddp_notebook
import fake_libraries
from ddp_notebook.engine import template
from nbrun import KEEP_DEBUG_LOG, execute, kernel

pytestmark = pytest.mark.timeout(300)


def _what_a_rank_sees():
    import ctypes
    import logging
    import os

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    native = getenv(b"TORCHELASTIC_SIGNALS_TO_HANDLE")
    return {
        "ppid": os.getppid(), "user": os.environ.get("DDPNB_TEST_USER_VARIABLE"),
        "elastic": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE"),
        "elastic_native": native.decode() if native is not None else None,  # what C code reading it now sees
        "dynamo_log_level": logging.getLogger("torch._dynamo").level,  # TORCH_LOGS, applied as torch imports
        "mkl": os.environ.get("MKL_DDPNB_TEST"),
    }


def _fresh_template() -> int:
    template.stop()
    started = template.ready_template()
    assert started is not None
    return started.proc.pid


def test_variables_read_when_used_reach_ranks_forked_from_the_same_template(monkeypatch, no_leftovers):
    template_pid = _fresh_template()
    monkeypatch.setenv("DDPNB_TEST_USER_VARIABLE", "set after the template started")
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM")  # what accelerate's launcher leaves set
    for _ in range(2):
        seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
        assert [r["ppid"] for r in seen] == [template_pid] * 2  # forked from it, not started fresh
        for rank_saw in seen:
            assert rank_saw["user"] == "set after the template started"
            assert rank_saw["elastic"] == rank_saw["elastic_native"] == "SIGTERM"
    monkeypatch.delenv("TORCHELASTIC_SIGNALS_TO_HANDLE")  # removed: the ranks see it gone
    seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert [(r["ppid"], r["elastic"], r["elastic_native"]) for r in seen] == [(template_pid, None, None)] * 2
    assert template.current_pid() == template_pid


@pytest.mark.parametrize("name, value", [("TORCH_LOGS", "+dynamo"), ("MKL_DDPNB_TEST", "1")],
                         ids=["looked-up-by-torch", "read-by-native-code"])
def test_a_variable_the_template_read_at_import_makes_a_new_template_the_ranks_start_from(monkeypatch, name, value,
                                                                                         no_leftovers):
    first = _fresh_template()
    assert template.current().read_at_import(name, value) == ("torch" if name == "TORCH_LOGS" else "native code")
    before = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
    assert [r["ppid"] for r in before] == [first] * 2
    monkeypatch.setenv(name, value)
    for _ in range(2):  # the first job after the change and the next ones: all from the new template
        seen = ddp_notebook.launch(_what_a_rank_sees, cpus=2)
        second = template.current_pid()
        assert second not in (None, first) and [r["ppid"] for r in seen] == [second] * 2
    if name == "TORCH_LOGS":  # the rank's torch imported with it, as a fresh process's would
        assert [r["dynamo_log_level"] for r in seen] == [10, 10] != [r["dynamo_log_level"] for r in before]
    else:
        assert [r["mkl"] for r in seen] == ["1", "1"]


_OPENMP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import ddp_notebook
    from ddp_notebook.engine import template

    def seen():
        import os
        return [os.getppid(), os.environ.get("KMP_DUPLICATE_LIB_OK"), os.environ.get("KMP_INIT_AT_FORK"),
                os.environ.get("KMP_AFFINITY")]

    def step(name):
        ranks = ddp_notebook.launch(seen, cpus=2)
        current = template.current()
        print(json.dumps({"step": name, "first": first.proc.pid, "template": current.proc.pid, "ranks": ranks,
                          "set_where_unset": current.set_where_unset, "affinity_read_by":
                          current.read_at_import("KMP_AFFINITY", "disabled"),
                          "stale": current.stale_for(dict(os.environ, KMP_INIT_AT_FORK="TRUE"))}), flush=True)

    first = template.ready_template()  # started before the script imports torch._dynamo and scikit-learn
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    import torch._dynamo  # works out TORCHINDUCTOR_CACHE_DIR and sets it, as the template's import did
    assert "TORCHINDUCTOR_CACHE_DIR" in os.environ
    import sklearn  # sets KMP_DUPLICATE_LIB_OK=True and KMP_INIT_AT_FORK=FALSE where unset, as joblib does
    first.preload()
    assert first.wait_preloaded() and "sklearn" in first.preloaded, first.preloaded
    step("scikit-learn imported")
    os.environ["KMP_INIT_AT_FORK"] = "TRUE"  # another value than the library's: a fresh import keeps it
    step("another value")
    sys.path.insert(0, sys.argv[1])
    import ddpnb_fake_llvm_openmp  # loads LLVM's OpenMP, which reads KMP_* as it loads
    loading = template.current()
    loading.preload()
    assert loading.wait_preloaded() and "ddpnb_fake_llvm_openmp" in loading.preloaded
    print(json.dumps({"affinity_read_by": loading.read_at_import("KMP_AFFINITY", "disabled")}), flush=True)
    os.environ["KMP_AFFINITY"] = "disabled"
    step("LLVM's OpenMP loaded")
""")


def test_what_scikit_learn_sets_as_it_imports_keeps_the_template_unless_an_openmp_that_reads_it_is_loaded(
        tmp_path):
    """scikit-learn (the quickstart's second cell) and joblib set ``KMP_DUPLICATE_LIB_OK`` and ``KMP_INIT_AT_FORK``
    where unset as they import, and torch._dynamo sets ``TORCHINDUCTOR_CACHE_DIR`` (the seed recipe's kernel imports
    it): the template that imports them sets the same values, and only Intel's and LLVM's OpenMP read ``KMP_*``
    (torch's wheels load GNU's), so the template serves the next jobs and their ranks see the values.  A value
    other than the library's, or a template that has loaded LLVM's OpenMP (a library the script imported,
    preloaded), makes the next job's ranks come from a new template."""
    if not os.path.exists("/usr/lib/x86_64-linux-gnu/libomp.so.5"):
        why = "LLVM's OpenMP runtime (apt's libomp5, which .ci/run installs)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    fake_libraries.install(tmp_path, "ddpnb_fake_llvm_openmp", 'import ctypes\nctypes.CDLL("libomp.so.5")\n')
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("KMP_") and name != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", _OPENMP_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=240)
    assert done.returncode == 0, done.stderr
    steps = [json.loads(line) for line in done.stdout.splitlines()]
    imported, other_value, read_by, loaded = steps
    first = imported["template"]
    assert first == imported["first"]  # the template started before the imports is the one the job forked from
    assert imported["ranks"] == [[first, "True", "FALSE", None]] * 2  # with the values of now
    assert imported["affinity_read_by"] is None  # nothing loaded reads KMP_AFFINITY
    assert {name: value for name, (value, _) in imported["set_where_unset"].items() if name.startswith("KMP_")} == {
        "KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE"}
    assert re.fullmatch(r"KMP_INIT_AT_FORK \(read by (joblib|sklearn|threadpoolctl)\)", " ".join(imported["stale"]))
    second = other_value["template"]
    assert second != first and other_value["ranks"] == [[second, "True", "TRUE", None]] * 2
    assert read_by == {"affinity_read_by": "libomp.so.5"}
    third = loaded["template"]
    assert third not in (first, second) and loaded["ranks"] == [[third, "True", "TRUE", "disabled"]] * 2


def test_a_job_whose_own_variables_the_template_read_starts_fresh_ranks():
    current = template.ready_template()
    assert current.stale_for(dict(current.env, MKL_DDPNB_TEST="1")) == ["MKL_DDPNB_TEST (read by native code)"]
    assert current.stale_for(dict(current.env, DDPNB_TEST_USER_VARIABLE="1", RANK="3", MASTER_PORT="1")) == []
    assert current.fork({}, dict(current.env, MKL_DDPNB_TEST="1"), os.getcwd(), None) is None


def test_the_template_counts_look_ups_by_name_not_reads_of_the_whole_environment(monkeypatch):
    """What the template records as it imports (``rank/template.py``): ``os.getenv``, ``.get``, ``[]`` and ``in``
    of a name, found or not; never a copy of the whole environment (``subprocess``, ``dict(os.environ)``), which
    would make every variable set when the template started look read."""
    from ddp_notebook.rank.template import environment_reads

    monkeypatch.setenv("DDPNB_TEST_COPIED", "1")
    with environment_reads() as read:
        dict(os.environ)
        os.environ.copy()
        list(os.environ.items())
        os.getenv("DDPNB_TEST_GETENV")
        os.environ.get("DDPNB_TEST_GET")
        "DDPNB_TEST_IN" in os.environ
        os.environ.copy()
        os.environ["DDPNB_TEST_COPIED"]  # by name, after a copy
    assert read.looked_up == {"DDPNB_TEST_GETENV", "DDPNB_TEST_GET", "DDPNB_TEST_IN", "DDPNB_TEST_COPIED"}
    assert type(os.environ) is os._Environ  # a rank forked later has the plain mapping


def test_a_variable_a_library_finds_unset_and_sets_is_noted_with_its_value_and_not_as_read(monkeypatch):
    """A variable found unset and left set (joblib's ``os.environ.setdefault("KMP_INIT_AT_FORK", ...)``, or a
    default worked out and stored, as torch._dynamo's ``TORCHINDUCTOR_CACHE_DIR``) is noted with the value left, and
    a later look-up reads that value, which a fresh import would leave too; one found set was read."""
    from ddp_notebook.rank.template import environment_reads

    for name in ("DDPNB_TEST_DEFAULTED", "DDPNB_TEST_WORKED_OUT", "DDPNB_TEST_UNSET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DDPNB_TEST_PRESENT", "mine")
    with environment_reads() as read:
        assert os.environ.setdefault("DDPNB_TEST_DEFAULTED", "FALSE") == "FALSE"
        assert os.environ.get("DDPNB_TEST_DEFAULTED") == "FALSE"
        assert os.environ.setdefault("DDPNB_TEST_PRESENT", "other") == "mine"
        os.environ["DDPNB_TEST_WORKED_OUT"] = os.path.abspath(os.environ.get("DDPNB_TEST_WORKED_OUT", "cache"))
        assert os.getenv("DDPNB_TEST_UNSET") is None  # (found unset, left unset: read)
    assert read.looked_up == {"DDPNB_TEST_PRESENT", "DDPNB_TEST_UNSET"}
    assert read.set_where_unset == {"DDPNB_TEST_DEFAULTED": "FALSE", "DDPNB_TEST_WORKED_OUT": os.path.abspath("cache")}
    with environment_reads() as later:
        os.environ.get("DDPNB_TEST_DEFAULTED")  # the value an import left: not read
    assert later.looked_up == set() and later.set_where_unset == {}


def test_a_variable_one_module_found_unset_and_another_set_was_read(monkeypatch):
    """Library A reads a variable while it is unset (and goes on without it), library B then sets it: a fresh
    import with the value set would give A another start, so it counts as read; so does one its setter found unset
    twice before setting it."""
    from ddp_notebook.rank.template import environment_reads

    for name in ("DDPNB_TEST_READ_BY_A", "DDPNB_TEST_FOUND_TWICE"):
        monkeypatch.delenv(name, raising=False)
    with environment_reads() as read:
        exec("import os\nos.environ.get('DDPNB_TEST_READ_BY_A')", {"__name__": "ddpnb_library_a"})
        exec("import os\nos.environ['DDPNB_TEST_READ_BY_A'] = 'b'", {"__name__": "ddpnb_library_b"})
        exec("import os\nos.getenv('DDPNB_TEST_FOUND_TWICE')\nos.environ.setdefault('DDPNB_TEST_FOUND_TWICE', '1')",
             {"__name__": "ddpnb_library_c"})
    assert read.looked_up == {"DDPNB_TEST_READ_BY_A", "DDPNB_TEST_FOUND_TWICE"}
    assert read.set_where_unset == {}


_GETENV_LOGGER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
static void note(const char *name) {
    int fd = open(LOG_PATH, O_WRONLY | O_APPEND | O_CREAT, 0600);
    if (fd >= 0) { write(fd, name, strlen(name)); write(fd, "\n", 1); close(fd); }
}
char *getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "getenv");
    note(name);
    return real(name);
}
char *secure_getenv(const char *name) {
    static char *(*real)(const char *);
    if (!real) real = dlsym(RTLD_NEXT, "secure_getenv");
    note(name);
    return real(name);
}
"""

_IMPORTS = textwrap.dedent("""
    import ctypes
    getenv = ctypes.CDLL(None).getenv
    getenv(b"DDPNB_MARK_IMPORTS")
    import cloudpickle, numpy, torch, torch.distributed, torch.utils.data
    from ddp_notebook.rank import template, worker
    import torch._dynamo, torch.nn.parallel
    getenv(b"DDPNB_MARK_DONE")
""")


def test_what_native_code_reads_as_torch_loads_is_what_the_template_counts_as_read(tmp_path):
    """The names native code reads while the template's imports run (torch, numpy, the rank side, the first
    preloads), through a getenv interposer: every one is one the template treats as read at import."""
    if shutil.which("gcc") is None:
        why = "the getenv interposer is built with gcc (.ci/run installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    log = tmp_path / "getenv.log"
    source = tmp_path / "getenv_logger.c"
    source.write_text(_GETENV_LOGGER.replace("LOG_PATH", json.dumps(str(log))))
    shim = tmp_path / "getenv_logger.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(shim), str(source), "-ldl"], check=True)
    subprocess.run([sys.executable, "-c", _IMPORTS], check=True, env=dict(os.environ, LD_PRELOAD=str(shim)))
    names = log.read_text().split()
    window = names[names.index("DDPNB_MARK_IMPORTS") + 1:names.index("DDPNB_MARK_DONE")]
    assert len(window) > 20  # OpenMP, MKL, oneDNN, libtorch... (an empty window would prove nothing)
    assert sorted({name for name in window if not template.read_by_native_code(name)}) == []


_FAKE_LIBRARY = 'import os\nSETTING = os.environ.get("DDPNB_FAKE_ENVLIB_SETTING")\n'

_KERNEL_SETUP = KEEP_DEBUG_LOG + textwrap.dedent("""
    import json, logging, os, sys, time
    import ddp_notebook
    from ddp_notebook.engine import template as t

    def seen():
        import logging, os, ddpnb_fake_envlib
        return {"ppid": os.getppid(), "user": os.environ.get("WANDB_PROJECT"),
                "elastic": os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE"),
                "setting": ddpnb_fake_envlib.SETTING, "env_setting": os.environ.get("DDPNB_FAKE_ENVLIB_SETTING"),
                "dynamo_log_level": logging.getLogger("torch._dynamo").level}
""")


def test_in_a_kernel_a_change_in_the_cell_of_the_jobs_keeps_them_forked_and_a_library_read_makes_a_new_template(
        tmp_path, no_leftovers):
    fake_libraries.install(tmp_path, "ddpnb_fake_envlib", _FAKE_LIBRARY)  # installed: the template preloads it
    with kernel() as (km, kc):
        said = execute(kc, [
            _KERNEL_SETUP,
            f"sys.path.insert(0, {str(tmp_path)!r})\nimport ddpnb_fake_envlib",
            # after a job and a cell the template preloads the library; wait until it has
            "ddp_notebook.launch(seen, cpus=2)",
            "first = t.current(); assert first.wait_preloaded(); print('PRELOADED', 'ddpnb_fake_envlib' in "
            "first.preloaded, first.read_at_import('DDPNB_FAKE_ENVLIB_SETTING', 'new'))",
            # one cell, as Run All runs it: a user's variable and one torch elastic reads when used, then three jobs
            "os.environ['WANDB_PROJECT'] = 'demo'\nos.environ['TORCHELASTIC_SIGNALS_TO_HANDLE'] = 'SIGTERM'\n"
            "print('SAME ' + json.dumps([ddp_notebook.launch(seen, cpus=2) for _ in range(3)] + [first.proc.pid]))",
            # a variable the preloaded library read as it imported: the rank must see what a fresh import sees
            "os.environ['DDPNB_FAKE_ENVLIB_SETTING'] = 'new'\n"
            "print('NEW ' + json.dumps([ddp_notebook.launch(seen, cpus=2) for _ in range(2)] + [t.current_pid()]))",
            "print('NOTEBOOK', ddpnb_fake_envlib.SETTING)",
            # between jobs, in a cell of its own, one torch read as it imported: a new template from the cell's end
            "before_change = t.current_pid()\nos.environ['TORCH_LOGS'] = '+dynamo'",
            "print('AT THE END OF THE CELL', before_change, t.current_pid())",
            "print('TORCH ' + json.dumps([ddp_notebook.launch(seen, cpus=2), t.current_pid()]))",
            "print('LOG ' + json.dumps(DEBUG_LOG))",
        ])
    assert "PRELOADED True ddpnb_fake_envlib" in said
    *same, first_pid = json.loads(re.search(r"SAME (.*)", said).group(1))
    for job in same:
        assert job == [{"ppid": first_pid, "user": "demo", "elastic": "SIGTERM", "setting": None,
                        "env_setting": None, "dynamo_log_level": 0}] * 2
    *new, second_pid = json.loads(re.search(r"NEW (.*)", said).group(1))
    assert second_pid != first_pid
    for job in new:
        assert job == [{"ppid": second_pid, "user": "demo", "elastic": "SIGTERM", "setting": "new",
                        "env_setting": "new", "dynamo_log_level": 0}] * 2
    assert "NOTEBOOK None" in said  # imported before the change, the notebook's own copy kept what it read
    before_change, at_the_end = (int(n) for n in re.search(r"AT THE END OF THE CELL (\d+) (\d+)", said).groups())
    assert before_change == second_pid and at_the_end != second_pid  # started as the changing cell ended
    job, third_pid = json.loads(re.search(r"TORCH (.*)", said).group(1))
    assert third_pid == at_the_end
    assert job == [{"ppid": third_pid, "user": "demo", "elastic": "SIGTERM", "setting": "new", "env_setting": "new",
                    "dynamo_log_level": 10}] * 2
    log = json.loads(re.search(r"LOG (.*)", said).group(1))
    assert any("forked with the environment of now" in line and "WANDB_PROJECT" in line for line in log)
    assert any("replaced" in line and "DDPNB_FAKE_ENVLIB_SETTING (read by ddpnb_fake_envlib)" in line for line in log)
