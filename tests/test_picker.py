"""The GPU picker: its widgets and choice in-process, then in a real kernel feeding a %%ddp cell."""
import os
import subprocess
import sys

import pytest

import fake_nvml
from conftest import ROOT
from ddp_notebook import LaunchError
from ddp_notebook.engine import devices as gpus
from ddp_notebook.engine import spec as job_spec
from ddp_notebook.notebook import picker
from nbrun import run_cells, text

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def clean_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("DDP_NOTEBOOK_RESERVATIONS", str(tmp_path / "reservations"))  # no other test's
    monkeypatch.setattr(job_spec, "_default_devices", None)
    monkeypatch.setattr(picker, "_active", None)


@pytest.mark.timeout(30)
def test_picker_on_the_8_gpu_server_ticks_free_gpus_and_feeds_the_launcher(clean_defaults, monkeypatch):
    server = fake_nvml.server8()
    monkeypatch.setattr(gpus, "_nvml_override", server)
    panel = picker.gpu_picker()
    assert picker.active_picker() is panel
    assert list(panel.checkboxes) == list(range(8))
    assert [i for i, box in panel.checkboxes.items() if box.value] == [1, 3, 6]  # the GPUs that are not busy
    assert panel.selection == ("gpus", [1, 3, 6])
    assert "<b>3 ranks</b> on GPU 1, 3, 6 (nccl)" in panel.summary.value
    row0 = panel.rows.children[0].children[1].value
    assert "NVIDIA A100-SXM4-80GB" in row0 and "71.3/80 GiB, 97%" in row0 and "2 other processes" in row0
    assert "NVML, driver 550.54.15" in panel.header.value

    spec = job_spec.resolve_devices()
    assert spec.gpus == [fake_nvml.UUIDS[i] for i in (1, 3, 6)] and spec.world_size == 3 and spec.backend == "nccl"
    assert spec.notes == ["using the gpus chosen in the GPU picker: [1, 3, 6]"]
    spec.release_devices()  # (its job ended)
    panel.checkboxes[6].value = False
    panel.checkboxes[0].value = True
    assert job_spec.resolve_devices().gpus == [fake_nvml.UUIDS[i] for i in (0, 1, 3)]
    assert "<b>3 ranks</b> on GPU 0, 1, 3" in panel.summary.value
    assert job_spec.resolve_devices(cpus=2).gpus is None  # explicit flags win
    assert job_spec.resolve_devices(2).gpus == [fake_nvml.UUIDS[i] for i in (1, 3)]

    for box in panel.checkboxes.values():
        box.value = False
    assert panel.selection is None and "No GPU ticked" in panel.summary.value
    with pytest.raises(LaunchError, match="the GPU picker has no GPU ticked"):
        job_spec.resolve_devices()

    # Refresh: new readings, the user's ticks stay.
    panel.checkboxes[4].value = True
    server.rows[4][1], server.rows[4][2] = 100, 0  # the job on GPU 4 ended
    server.rows[4][3] = []
    readings = server.calls.count("nvmlInit")
    panel.refresh()
    assert panel.selection == ("gpus", [4])
    assert "0.1/80 GiB, 0%" in panel.rows.children[4].children[1].value
    assert server.calls.count("nvmlInit") == readings + 1 and server.initialised == 0


@pytest.mark.timeout(30)
def test_picker_marks_gpus_running_a_job_of_ours(clean_defaults, monkeypatch):
    rank = subprocess.Popen([sys.executable, "-m", "ddp_notebook.rank.worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, DDP_NOTEBOOK_RANK="0"))
    try:
        monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8(extra_processes={3: [rank.pid]}))
        panel = picker.gpu_picker()
        # GPU 3 would be free but runs a rank of ours: not ticked, and said so in red.
        assert panel.selection == ("gpus", [1, 6])
        row3 = panel.rows.children[3].children[1].value
        assert "color:#c62828" in row3 and "ddp_notebook job of this notebook (rank 0)" in row3
        panel.checkboxes[3].value = True
        assert "GPU 3 already run a ddp_notebook job." in panel.summary.value
    finally:
        rank.kill()
        rank.wait()
        rank.stdin.close()


@pytest.mark.timeout(30)
def test_picker_without_gpus_offers_cpu_ranks_and_a_newer_panel_takes_over(clean_defaults, monkeypatch):
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.FakeNVML(rows=[]))
    first = picker.gpu_picker()
    assert first.header.value.startswith("<b>No GPU on this machine</b>")
    assert first.rows.children == (first.cpu_ranks,)
    assert first.selection == ("cpus", 2) and job_spec.resolve_devices().world_size == 2
    first.cpu_ranks.value = 5
    assert "<b>5 CPU ranks</b> (gloo)" in first.summary.value
    spec = job_spec.resolve_devices()
    assert (spec.world_size, spec.gpus, spec.backend) == (5, None, "gloo")
    assert spec.notes == ["using the cpus chosen in the GPU picker: 5"]

    second = picker.gpu_picker()  # starts from the first one's choice, and is now in charge
    assert second.cpu_ranks.value == 5 and picker.active_picker() is second
    assert "newer GPU picker" in first.summary.value
    first.cpu_ranks.value = 7  # the old panel no longer decides
    assert job_spec.resolve_devices().world_size == 5
    second.close()
    assert picker.active_picker() is None and job_spec._default_devices is None
    assert job_spec.resolve_devices().world_size == job_spec.DEFAULT_CPU_RANKS


@pytest.mark.timeout(30)
def test_the_plain_equivalent_chooses_without_widgets_and_the_panel_names_it(clean_defaults, monkeypatch):
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8())
    panel = picker.gpu_picker()
    plain = panel._repr_mimebundle_()["text/plain"]  # what a front end without a widget manager shows
    assert plain.startswith("[GPU picker: needs a widget manager (GPU 0 NVIDIA A100-SXM4-80GB: 71.3/80 GiB, 97%")
    assert plain.endswith("instead: %ddp_gpus 0,1 (the GPU indices to use) or %ddp_gpus off]")

    assert picker.choose("0,2") == "cells that name no devices run on GPU 0, 2"
    assert picker.active_picker() is None and "This choice was dropped" in panel.summary.value
    spec = job_spec.resolve_devices()
    assert (spec.gpus, spec.world_size, spec.backend) == ([fake_nvml.UUIDS[0], fake_nvml.UUIDS[2]], 2, "nccl")
    with pytest.raises(LaunchError, match=r"%ddp_gpus: no GPU 8, 9 here; this kernel's GPUs: 0, 1, 2, 3, 4, 5, 6, 7"):
        picker.choose("1,8,9")
    with pytest.raises(LaunchError, match=r"%ddp_gpus: 'two' is not a choice: GPU indices like 0,1, 'cpus 3'"):
        picker.choose("two")
    assert job_spec.resolve_devices().gpus == [fake_nvml.UUIDS[0], fake_nvml.UUIDS[2]]  # a refused choice changes nothing
    assert picker.choose("cpus 3") == "cells that name no devices run 3 CPU ranks"
    assert job_spec.resolve_devices().world_size == 3 and job_spec.resolve_devices().gpus is None


def _widget_models(client):
    state = client.widget_state if hasattr(client, "widget_state") else {}
    return {mid: m.get("state", m) for mid, m in state.items()}


@pytest.mark.timeout(150)
@pytest.mark.slow
@pytest.mark.kernel
def test_cpu_picker_choice_feeds_the_next_ddp_cell_in_a_real_kernel(no_leftovers):
    nb, client = run_cells([
        f"import sys; sys.path.insert(0, {TESTS!r})\n"
        "import fake_nvml\n"
        "from ddp_notebook.engine import devices as gpus, spec as job_spec\n"
        "gpus._nvml_override = fake_nvml.FakeNVML(rows=[])  # a machine without GPUs, whatever this one has\n"
        "%load_ext ddp_notebook",
        "%ddp_gpus",
        # The user sets 3 CPU ranks in the panel (here through the widget's value, as a click would).
        "from ddp_notebook.notebook import picker\n"
        "panel = picker.active_picker()\n"
        "panel.cpu_ranks.value = 3\n"
        "print('selection', panel.selection)",
        "%%ddp\nimport torch.distributed as dist\nprint('world_size', world_size, dist.get_world_size(), 'rank', rank)",
        "%%ddp --cpus 2\nprint('explicit', world_size)",
        "%ddp_gpus 3",
        "%ddp_gpus off\nprint('default after off:', job_spec._default_devices)",
    ], timeout=120, cwd=ROOT)
    cells = nb.cells
    views = [o for o in cells[1].outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1, cells[1].outputs
    models = _widget_models(client)
    assert models[views[0]["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]]["_view_name"] == "VBoxView"
    htmls = [m.get("value", "") for m in models.values() if m.get("_model_name") == "HTMLModel"]
    assert any("No GPU on this machine" in h for h in htmls), htmls
    ints = [m for m in models.values() if m.get("_model_name") == "BoundedIntTextModel"]
    assert [m["value"] for m in ints] == [3] and ints[0]["description"] == "CPU ranks"
    assert text(cells[2]).strip() == "selection ('cpus', 3)"
    out = text(cells[3])
    assert sorted(line for line in out.splitlines() if "world_size" in line) == \
        [f"[rank {r}] world_size 3 3 rank {r}" for r in range(3)], out
    assert "using the cpus chosen in the GPU picker: 3" in out
    explicit = sorted(line for line in text(cells[4]).splitlines() if "explicit" in line)
    assert explicit == ["[rank 0] explicit 2", "[rank 1] explicit 2"]
    assert "chosen in the GPU picker" not in text(cells[4])
    assert all("Traceback" not in text(cell) for cell in cells)
    assert "UsageError: %ddp_gpus: no GPU 3 here; this kernel's GPUs: none" in text(cells[5])
    assert text(cells[6]).strip() == "default after off: None"
