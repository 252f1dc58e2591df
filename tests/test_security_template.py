"""Another user plants modules in a shared working folder: neither the rank template nor a rank imports them.

Issue 36, item 5, against a real second Unix user (tests/test_security_files.py's): after the notebook imported a
library and moved into a 0777 folder that is not sticky, that user plants a module of the library's name there, and
``torch.py`` and ``cloudpickle.py`` beside it.  Each planted module, if imported, would leave a file saying who ran
it; none may appear.  Real templates, real ranks over gloo (forked and fresh).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import pytest

import ddp_notebook
from ddp_notebook.engine import template
from test_security_files import other_user, run_as  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(300)

LIBRARY = "ddpnb_fake_victimlib"
PLANTED = ("import os\nopen(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'RAN-' + __name__ + '-' "
           "+ str(os.getuid())), 'w').close()\n")


def _rank_imports():
    import os
    import sys

    import ddpnb_fake_victimlib  # the notebook's library, imported by name as a cell would
    import cloudpickle
    import torch

    return {"library": ddpnb_fake_victimlib.__file__, "torch": torch.__file__, "cloudpickle": cloudpickle.__file__,
            "cwd": os.getcwd(), "cwd_on_path": os.getcwd() in sys.path}


@pytest.fixture
def planted(other_user, monkeypatch, tmp_path):  # noqa: F811
    """The notebook has imported the real library (an installed one, from a private folder), then moved into a
    shared 0777 folder where the other user planted look-alikes; yields that folder."""
    installed = tmp_path / "site"
    installed.mkdir()
    (installed / f"{LIBRARY}.py").write_text("REAL = True\n")
    info = installed / f"{LIBRARY}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {LIBRARY}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(LIBRARY + "\n")
    monkeypatch.setattr(sys, "path", ["", *sys.path, str(installed)])  # as a kernel's: the working folder first
    monkeypatch.delitem(sys.modules, LIBRARY, raising=False)
    __import__(LIBRARY)
    import ddp_notebook.notebook.magic  # noqa: F401  what %load_ext imports (the kernel's own cloudpickle with it)
    shared = tempfile.mkdtemp(prefix="ddpnb-shared-", dir="/tmp")
    os.chmod(shared, 0o777)  # a group project folder: anyone writes, and it is not sticky

    def plant():
        for name in (LIBRARY, "torch", "cloudpickle"):
            with open(os.path.join(shared, name + ".py"), "w") as f:
                f.write(PLANTED)

    run_as(other_user, plant)
    monkeypatch.chdir(shared)
    yield shared
    shutil.rmtree(shared)


def _ran(folder: str) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("RAN-"))


def test_the_template_never_imports_a_library_planted_in_the_working_folder(planted, no_leftovers):
    template.stop()
    while True:  # started in the shared folder; preloads the notebook's libraries, as after a cell (one of this
        started = template.ready_template()  # test process's that starts a thread taints it: it is replaced)
        started.preload()
        assert started.wait_preloaded()
        if started.tainted is None:
            break
    assert LIBRARY not in started.preloaded
    assert "not the notebook's" in template.left_to_ranks()[LIBRARY]
    seen = ddp_notebook.launch(_rank_imports, cpus=2)
    assert template.current_pid() == started.proc.pid  # left to the ranks, the template kept
    for rank_saw in seen:
        assert rank_saw["library"] == sys.modules[LIBRARY].__file__  # the notebook's, not the planted one
        assert not rank_saw["torch"].startswith(planted) and not rank_saw["cloudpickle"].startswith(planted)
        assert rank_saw["cwd"] == planted and rank_saw["cwd_on_path"]  # the notebook's path, as it is
    assert _ran(planted) == []


def test_fresh_ranks_never_import_their_own_modules_or_the_notebooks_from_the_working_folder(planted, monkeypatch,
                                                                                          no_leftovers):
    monkeypatch.setenv("DDP_NOTEBOOK_TEMPLATE", "0")
    seen = ddp_notebook.launch(_rank_imports, cpus=2)
    for rank_saw in seen:
        assert rank_saw["library"] == sys.modules[LIBRARY].__file__
        assert not rank_saw["torch"].startswith(planted) and not rank_saw["cloudpickle"].startswith(planted)
    assert _ran(planted) == []
