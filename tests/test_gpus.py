"""GPU discovery, the least-busy choice, CUDA_VISIBLE_DEVICES and device resolution (no rank is started).

NVML answers come from a recording of an 8x A100 server under mixed load
(tests/fake_nvml.py); the rest -- psutil lookups, remapping, the launcher's
decisions -- runs for real.
"""
import os
import subprocess
import sys
import types

import psutil
import pytest

import fake_nvml
from ddp_notebook import LaunchError
from ddp_notebook.engine import devices as gpus
from ddp_notebook.engine import spec as job_spec
from ddp_notebook.__main__ import main as cli_main

pytestmark = pytest.mark.timeout(30)
GiB = 2**30
MiB = 2**20


def uuids(*physical):
    """The recorded GPUs' UUIDs: what ranks get in CUDA_VISIBLE_DEVICES."""
    return [fake_nvml.UUIDS[i] for i in physical]


@pytest.fixture
def server(monkeypatch, tmp_path):
    """The recorded 8-GPU server, with no CUDA_VISIBLE_DEVICES, no default devices, and no reservations."""
    monkeypatch.setenv("DDP_NOTEBOOK_RESERVATIONS", str(tmp_path / "reservations"))
    fake = fake_nvml.server8()
    monkeypatch.setattr(gpus, "_nvml_override", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(job_spec, "_default_devices", None)
    return fake


def test_discovery_reads_every_gpu_of_the_recorded_server(server):
    found, source = gpus.discover_report()
    assert source == "NVML, driver 550.54.15"
    assert [g.index for g in found] == list(range(8))
    assert [g.physical_index for g in found] == list(range(8))
    assert {g.name for g in found} == {"NVIDIA A100-SXM4-80GB"}
    assert all(g.memory_total == 81920 * MiB for g in found)
    g0, g4 = found[0], found[4]
    assert g0.memory_used == 73021 * MiB and g0.utilization == 97
    assert g4.memory_free == (81920 - 79873) * MiB and g4.utilization == 100
    assert [p.pid for p in g0.processes] == [2210441, 2210442]
    assert g0.processes[0].memory_used == 36480 * MiB
    assert found[1].processes == [] and found[1].jobs_text() == "idle"
    assert found[2].jobs_text() == "1 other process"
    assert not any(p.ours for g in found for p in g.processes)  # recorded pids are not ranks of ours
    assert [g.uuid for g in found] == fake_nvml.UUIDS
    # Ranks get the UUID NVML read (exact, whatever order CUDA numbers GPUs in), not NVML's index.
    assert [g.visible_id for g in found] == fake_nvml.UUIDS
    # NVML is opened and closed once per reading.
    assert server.calls.count("nvmlInit") == server.calls.count("nvmlShutdown") == 1
    assert server.initialised == 0
    # Busy means: memory or compute in real use, or a job of ours.
    assert [g.index for g in found if not g.busy] == [1, 3, 6]


def test_least_busy_prefers_free_memory_then_low_utilisation(server):
    found = gpus.discover()
    assert [g.index for g in gpus.least_busy(found, 8)] == [3, 1, 6, 5, 7, 2, 0, 4]
    # GPU 1 and 3 have the same free memory: 3 is idle (0%), 1 at 2%.
    assert [g.index for g in gpus.least_busy(found, 2)] == [3, 1]
    assert gpus.least_busy(found, 0) == []


def test_cuda_visible_devices_indices_are_renumbered_and_ranks_get_uuids(server, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2,7")
    found, source = gpus.discover_report()
    assert source.endswith("CUDA_VISIBLE_DEVICES=5,2,7")
    assert [(g.index, g.physical_index) for g in found] == [(0, 5), (1, 2), (2, 7)]
    assert [g.visible_id for g in found] == [fake_nvml.UUIDS[5], fake_nvml.UUIDS[2], fake_nvml.UUIDS[7]]
    assert found[0].utilization == 3 and found[1].utilization == 55
    # Indices the user types are relative to the kernel's view...
    spec = job_spec.resolve_devices("0,2")
    assert spec.gpus == [fake_nvml.UUIDS[5], fake_nvml.UUIDS[7]] and spec.world_size == 2
    spec.release_devices()  # (a job that ended)
    # ...and a count takes the least busy of the visible ones (5: 68 GiB free, then 7: 60 GiB).
    spec = job_spec.resolve_devices(2)
    assert spec.gpus == [fake_nvml.UUIDS[5], fake_nvml.UUIDS[7]]
    assert "using the 2 least busy GPUs free of other jobs: 0 (12.0/80 GiB, 3%), 2 (20.0/80 GiB, 88%)" in spec.notes[0]
    with pytest.raises(LaunchError, match=r"GPU 3 not found; this machine has 3: 0: NVIDIA A100"):
        job_spec.resolve_devices("3,")


def test_cuda_visible_devices_uuids_prefixes_and_cuda_s_stop_rule(server, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{fake_nvml.UUIDS[6]},GPU-9a1d3e55, 4")
    found = gpus.discover()
    assert [g.physical_index for g in found] == [6, 1, 4]
    assert [g.visible_id for g in found] == [fake_nvml.UUIDS[6], fake_nvml.UUIDS[1], fake_nvml.UUIDS[4]]
    # As CUDA does: the list ends at the first entry that names no GPU.
    for value, physical in [("3,GPU-ffffffff,1", [3]), ("2,9,1", [2]), ("1,1,2", [1]), ("-1", []), ("", []),
                            ("GPU-,0", [])]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
        assert [g.physical_index for g in gpus.discover()] == physical, value
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    spec = job_spec.resolve_devices()
    assert spec.gpus is None and spec.world_size == job_spec.DEFAULT_CPU_RANKS and spec.backend == "gloo"


def test_ranks_of_our_jobs_are_found_by_pid_and_named(server, monkeypatch):
    env = dict(os.environ, DDP_NOTEBOOK_RANK="1")
    # A real rank process, still waiting for its bootstrap on stdin: found by its pid, never by name.
    rank = subprocess.Popen([sys.executable, "-m", "ddp_notebook.rank.worker"], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8(extra_processes={4: [rank.pid], 1: [os.getpid()]}))
        found = gpus.discover()
        g4 = found[4]
        ours = g4.our_ranks
        assert [(p.pid, p.rank, p.kernel_pid) for p in ours] == [(rank.pid, 1, os.getpid())]
        assert [p.pid for p in g4.other_processes] == [2301877]
        assert g4.jobs_text() == "ddp_notebook job of this notebook (rank 1); 1 other process"
        # This pytest process is on GPU 1, but it is not a rank.
        assert found[1].processes[0].pid == os.getpid() and not found[1].processes[0].ours
        assert found[1].processes[0].name.startswith(psutil.Process().cmdline()[0])  # named by its command line
        assert [g.index for g in found if g.our_ranks] == [4]
        text = gpus.table(found, "NVML")
        assert "GPU 4 already run a ddp_notebook job." in text
        spec = job_spec.resolve_devices("4,")
        assert spec.notes == ["already running a ddp_notebook job: GPU 4: "
                              "ddp_notebook job of this notebook (rank 1); 1 other process"]
    finally:
        rank.kill()
        rank.wait()
        rank.stdin.close()


def test_torch_cuda_is_the_fallback_without_nvml(monkeypatch):
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.no_driver())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    props = [types.SimpleNamespace(name="NVIDIA H200", total_memory=150 * GiB, uuid=f"1234abcd-000{i}")
             for i in range(2)]
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2,
                                 get_device_properties=lambda i: props[i])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    found, source = gpus.discover_report()
    assert source == "torch.cuda, no load readings (NVML: NVML Shared Library Not Found)"
    assert [(g.index, g.name, g.visible_id, g.uuid) for g in found] == [
        (0, "NVIDIA H200", "GPU-1234abcd-0000", "GPU-1234abcd-0000"),
        (1, "NVIDIA H200", "GPU-1234abcd-0001", "GPU-1234abcd-0001")]  # the UUID, not the kernel's index entry
    assert found[0].utilization == -1 and found[0].load_text() == "0.0/150 GiB, util ?"
    cuda.is_available = lambda: False
    assert gpus.discover_report() == ([], "torch.cuda sees no GPU (NVML: NVML Shared Library Not Found)")


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="this machine has an NVIDIA driver")
def test_a_machine_without_driver_reports_no_gpu_and_why(monkeypatch):
    monkeypatch.setattr(gpus, "_nvml_override", None)  # the real nvidia-ml-py, no driver behind it
    found, source = gpus.discover_report()
    # Without NVML: "no NVIDIA driver (...)", or, when torch is already imported (as in a full test run),
    # torch.cuda is asked and says so; either way the reason NVML gave is named.
    assert found == [] and source.startswith(("no NVIDIA driver", "torch.cuda sees no GPU")) and "NVML" in source
    assert gpus.table(found, source).splitlines()[1] == \
        "%%ddp cells run CPU ranks with the gloo backend (--cpus N; 2 by default)."


def test_resolve_devices_counts_lists_and_refusals(server):
    spec = job_spec.resolve_devices(3)
    assert spec.world_size == 3 and spec.gpus == uuids(1, 3, 6) and spec.backend == "nccl"
    assert spec.notes == ["using the 3 least busy GPUs free of other jobs: 1 (0.0/80 GiB, 2%), 3 (0.0/80 GiB, 0%), "
                          "6 (0.5/80 GiB, 0%)"]
    spec.release_devices()
    everything = job_spec.resolve_devices("8")
    assert everything.gpus == fake_nvml.UUIDS and everything.notes == []
    everything.release_devices()
    assert job_spec.resolve_devices("0,2,5").gpus == uuids(0, 2, 5)
    assert job_spec.resolve_devices("5,0").gpus == uuids(5, 0)  # rank r gets the r-th listed GPU
    assert job_spec.resolve_devices("3,").gpus == uuids(3) and job_spec.resolve_devices("3,").world_size == 1
    assert job_spec.resolve_devices([7]).gpus == uuids(7)
    assert job_spec.resolve_devices(2, backend="gloo").backend == "gloo"
    assert job_spec.resolve_devices().gpus == fake_nvml.UUIDS  # no flag, no picker: every GPU
    with pytest.raises(LaunchError) as too_many:
        job_spec.resolve_devices(9)
    message = str(too_many.value)
    assert message.startswith("9 GPUs asked for, but this machine has 8: 0: NVIDIA A100-SXM4-80GB (71.3/80 GiB, 97%)")
    assert "7: NVIDIA A100-SXM4-80GB (20.0/80 GiB, 88%)" in message
    with pytest.raises(LaunchError, match=r"GPU 8, 9 not found; this machine has 8: 0: NVIDIA"):
        job_spec.resolve_devices("1,8,9")
    with pytest.raises(LaunchError, match="lists a GPU twice"):
        job_spec.resolve_devices("1,1")
    with pytest.raises(LaunchError, match="give a count"):
        job_spec.resolve_devices("two")
    with pytest.raises(LaunchError, match="at least 1"):
        job_spec.resolve_devices(0)
    with pytest.raises(LaunchError, match="no GPU index"):
        job_spec.resolve_devices(",")
    with pytest.raises(LaunchError, match="nccl backend needs GPUs"):
        job_spec.resolve_devices(cpus=2, backend="nccl")
    with pytest.raises(LaunchError, match="either gpus or cpus"):
        job_spec.resolve_devices(2, cpus=2)


def test_no_gpus_means_two_cpu_ranks_and_no_nccl(monkeypatch):
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.FakeNVML(rows=[]))
    monkeypatch.setattr(job_spec, "_default_devices", None)
    spec = job_spec.resolve_devices()
    assert (spec.world_size, spec.gpus, spec.backend) == (2, None, "gloo")
    with pytest.raises(LaunchError, match="this machine has none"):
        job_spec.resolve_devices(backend="nccl")
    with pytest.raises(LaunchError, match="1 GPUs asked for, but this machine has 0: no GPUs"):
        job_spec.resolve_devices(1)


def test_default_devices_from_the_picker_and_explicit_flags_win(server):
    job_spec.set_default_devices(lambda: ("gpus", [6, 1]))
    spec = job_spec.resolve_devices()
    assert spec.gpus == uuids(6, 1) and spec.backend == "nccl"
    assert spec.notes == ["using the gpus chosen in the GPU picker: [6, 1]"]
    spec.release_devices()
    assert job_spec.resolve_devices(cpus=3).world_size == 3  # explicit flags win
    assert job_spec.resolve_devices("2,").gpus == uuids(2)
    job_spec.set_default_devices(lambda: None)  # a picker with no opinion
    assert job_spec.resolve_devices().world_size == 8
    job_spec.set_default_devices(None)
    assert job_spec._default_devices is None
    assert job_spec.resolve_devices().world_size == 8


def test_cli_prints_the_table(server, capsys):
    assert cli_main(["gpus"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "GPUs (NVML, driver 550.54.15):"
    assert out[1].split() == ["GPU", "name", "memory", "used", "util", "free", "reservation;", "processes"]
    assert out[2].split()[:6] == ["0", "NVIDIA", "A100-SXM4-80GB", "71.3/80", "GiB", "97%"]
    assert out[2].endswith("2 other processes")
    assert out[4].split()[0] == "2" and out[4].endswith("1 other process")
    assert len(out) == 1 + 1 + 8 + 1
    assert out[-1] == "least busy first: 3, 1, 6, 5, 7, 2, 0, 4  (--gpus N takes the first N that no other job has " \
                      "reserved)"


def test_cli_runs_as_a_module_on_this_machine():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "ddp_notebook", "gpus"], capture_output=True, text=True,
                          cwd=root, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    if os.path.exists("/dev/nvidiactl"):
        assert first.startswith("GPUs (NVML, driver") or first.startswith("GPUs (torch.cuda")
    else:
        assert first.startswith("No GPU found: no NVIDIA driver")


def test_other_processes_show_owner_and_command_and_unseen_ones_are_not_called_free(server, monkeypatch):
    import getpass

    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8(extra_processes={1: [os.getpid()]}))
    found = {g.index: g for g in gpus.discover()}
    me = " ".join(psutil.Process().cmdline())
    assert found[1].jobs_text() == f"1 other process ({getpass.getuser()}: {me[:39] + '…' if len(me) > 40 else me})"
    assert found[3].jobs_text() == "idle"
    # In a container NVML lists no process of another container, though its memory is in use: not "idle".
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.FakeNVML(rows=[(0, 40960, 55, []), (1, 4, 0, [])]))
    unseen, idle = gpus.discover()
    assert unseen.jobs_text() == "in use by processes this machine cannot see (another container?)"
    assert idle.jobs_text() == "idle"


def test_one_unreadable_gpu_is_skipped_with_its_reason_and_the_others_kept(server, monkeypatch):
    # GPU 2 hidden from this container by cgroups (no handle), GPU 5 fallen off the bus (its memory reading fails).
    fake = fake_nvml.server8(failing={2: ("nvmlDeviceGetHandleByIndex", fake_nvml.NVML_ERROR_NO_PERMISSION),
                                      5: ("nvmlDeviceGetMemoryInfo", fake_nvml.NVML_ERROR_GPU_IS_LOST)})
    monkeypatch.setattr(gpus, "_nvml_override", fake)
    cuda_asked = []
    monkeypatch.setattr(gpus, "_discover_with_torch", lambda why: cuda_asked.append(why))  # must not be reached
    found, source = gpus.discover_report()
    assert cuda_asked == []  # never torch.cuda (it would initialise CUDA in the kernel) for one bad device
    assert [g.physical_index for g in found] == [0, 1, 3, 4, 6, 7]
    assert [g.visible_id for g in found] == uuids(0, 1, 3, 4, 6, 7)
    assert found.notes == ["GPU 2 skipped: NVML: Insufficient Permissions", "GPU 5 skipped: NVML: GPU is lost"]
    assert source == "NVML, driver 550.54.15; GPU 2 skipped: NVML: Insufficient Permissions; " \
                     "GPU 5 skipped: NVML: GPU is lost"
    assert fake.initialised == 0  # closed all the same
    assert gpus.table(found, source).splitlines()[0] == f"GPUs ({source}):"
    # A launch says so, and uses the readable GPUs.
    spec = job_spec.resolve_devices(2)
    assert spec.gpus == uuids(1, 3)
    assert spec.notes[:2] == found.notes
    spec.release_devices()
    # Every device unreadable: no GPU, the reasons named, still no torch.cuda.
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.FakeNVML(
        rows=[(0, 4, 2, []), (1, 4, 0, [])],
        failing={0: ("nvmlDeviceGetHandleByIndex", fake_nvml.NVML_ERROR_NO_PERMISSION),
                 1: ("nvmlDeviceGetName", fake_nvml.NVML_ERROR_GPU_IS_LOST)}))
    found, source = gpus.discover_report()
    assert found == [] and cuda_asked == []
    assert found.notes == ["GPU 0 skipped: NVML: Insufficient Permissions", "GPU 1 skipped: NVML: GPU is lost"]
    with pytest.raises(LaunchError, match=r"1 GPUs asked for, but this machine has 0: no GPUs \(GPU 0 skipped: "
                                          r"NVML: Insufficient Permissions; GPU 1 skipped: NVML: GPU is lost\)"):
        job_spec.resolve_devices(1)


def test_a_mig_instance_in_cuda_visible_devices_is_named_not_silently_dropped(server, monkeypatch):
    mig = "MIG-5d3c1a2b-8e7f-5a6b-9c0d-1e2f3a4b5c6d"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    found, source = gpus.discover_report()
    assert found == []
    assert len(found.notes) == 1 and f"CUDA_VISIBLE_DEVICES names a MIG instance, {mig}" in found.notes[0]
    assert source.startswith(f"NVML, driver 550.54.15; CUDA_VISIBLE_DEVICES={mig}; CUDA_VISIBLE_DEVICES names a MIG")
    # No flag: CPU ranks, as before, but the cell is told why.
    spec = job_spec.resolve_devices()
    assert (spec.world_size, spec.gpus, spec.backend) == (2, None, "gloo")
    assert spec.notes == found.notes + ["no GPU to use: running 2 CPU ranks (gloo)"]
    # GPUs asked for: refused, naming the MIG entry.
    with pytest.raises(LaunchError, match=f"this machine has 0: no GPUs \\(CUDA_VISIBLE_DEVICES names a MIG "
                                          f"instance, {mig}"):
        job_spec.resolve_devices(1)
    with pytest.raises(LaunchError, match=f"nccl backend needs GPUs, and this machine has none: .*{mig}"):
        job_spec.resolve_devices(backend="nccl")
    # Whole GPUs before it are used; the MIG entry and what follows are named.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"3,{mig},1")
    found = gpus.discover()
    assert [g.physical_index for g in found] == [3] and mig in found.notes[0]


def test_the_torch_fallback_keeps_mig_uuids_as_they_are(monkeypatch):
    mig = "MIG-5d3c1a2b-8e7f-5a6b-9c0d-1e2f3a4b5c6d"
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.no_driver())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mig)
    # torch's uuid of a MIG device carries no prefix: it must not become "GPU-...".
    props = types.SimpleNamespace(name="NVIDIA A100-SXM4-80GB MIG 1g.10gb", total_memory=10 * GiB,
                                  uuid=mig[len("MIG-"):])
    cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                                 get_device_properties=lambda i: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    found, source = gpus.discover_report()
    assert [(g.uuid, g.visible_id, g.lock_name) for g in found] == [(mig, mig, mig)]
    assert found.notes == [f"GPU 0 is a MIG instance ({mig}): one rank at most (NCCL does not join instances)"]
    assert source.endswith(found.notes[0])


def test_kernel_indices_counted_fastest_first_on_mixed_models_are_flagged(server, monkeypatch):
    names = ["NVIDIA A100-SXM4-80GB"] * 4 + ["NVIDIA H100 80GB HBM3"] * 4
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8(names=names))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)  # CUDA's default: FASTEST_FIRST
    found = gpus.discover()
    assert [g.physical_index for g in found] == [5, 2]
    assert len(found.notes) == 1 and "CUDA_VISIBLE_DEVICES=5,2 gives indices, which CUDA counts fastest first" \
        in found.notes[0] and "set CUDA_DEVICE_ORDER=PCI_BUS_ID, or give GPU UUIDs" in found.notes[0]
    assert job_spec.resolve_devices("0,").notes == found.notes
    # PCI bus order in the kernel, UUID entries, or one model: the reading is exact, nothing to say.
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert gpus.discover().notes == []
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(uuids(5, 2)))
    assert gpus.discover().notes == []
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,2")
    assert gpus.discover().notes == []
    # Without CUDA_VISIBLE_DEVICES, the table's numbers are nvidia-smi's: said where the kernel's may differ.
    monkeypatch.setattr(gpus, "_nvml_override", fake_nvml.server8(names=names))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "GPU numbers here are nvidia-smi's" in gpus.discover().notes[0]
