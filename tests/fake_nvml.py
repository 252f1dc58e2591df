"""Recorded NVML answers of an 8-GPU server under mixed load, served as a stand-in ``pynvml`` module.

Only the hardware is stood in for: :mod:`ddp_notebook.engine.devices` calls these the
way it calls nvidia-ml-py (same function names, same return shapes), and the
rest -- psutil lookups of the pids, CUDA_VISIBLE_DEVICES handling, the least
busy choice -- runs for real.  Inject with ``gpus._nvml_override = server8()``.

The numbers are those ``nvidia-smi`` shows for an 8x A100-SXM4-80GB box shared
by several people: two GPUs training flat out, one half-used, one holding
memory from an idle notebook, and four free (the freest differ only in
utilisation, to exercise the tie-break).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

MiB = 2**20
TOTAL = 81920 * MiB  # A100-SXM4-80GB as NVML reports it

# index, memory used (MiB), utilisation %, compute processes as (pid, used MiB)
RECORDED = [
    (0, 73021, 97, [(2210441, 36480), (2210442, 36480)]),
    (1, 4, 2, []),
    (2, 40960, 55, [(1988123, 40950)]),
    (3, 4, 0, []),
    (4, 79873, 100, [(2301877, 79860)]),
    (5, 12297, 3, [(1873300, 12288)]),
    (6, 517, 0, [(2412000, 512)]),
    (7, 20484, 88, [(2099001, 20480)]),
]
UUIDS = [
    "GPU-4f6f2a3c-0b1e-7d2a-9c35-1e0f5b7c8a01",
    "GPU-9a1d3e55-6c2b-41f0-8e7a-2b3c4d5e6f12",
    "GPU-0c8e7b6a-5d4c-4b3a-9f2e-3c4d5e6f7a23",
    "GPU-d2e3f4a5-b6c7-48d9-8e0f-4d5e6f7a8b34",
    "GPU-71b2c3d4-e5f6-4a7b-8c9d-5e6f7a8b9c45",
    "GPU-e8f9a0b1-c2d3-4e5f-8a6b-6f7a8b9c0d56",
    "GPU-35c6d7e8-f9a0-4b1c-9d2e-7a8b9c0d1e67",
    "GPU-aa0b1c2d-3e4f-4a5b-8c6d-8b9c0d1e2f78",
]
NAME = "NVIDIA A100-SXM4-80GB"
DRIVER = "550.54.15"


# Return codes and texts as NVML's nvmlErrorString gives them.
NVML_ERROR_NO_PERMISSION = 4  # a GPU hidden from this container by cgroups
NVML_ERROR_GPU_IS_LOST = 15  # fell off the bus
ERROR_TEXT = {NVML_ERROR_NO_PERMISSION: "Insufficient Permissions", NVML_ERROR_GPU_IS_LOST: "GPU is lost"}


class NVMLError(Exception):
    """As pynvml.NVMLError: carries the NVML return code."""

    def __init__(self, value: int, text: str):
        super().__init__(text)
        self.value = value


@dataclass
class _Handle:
    index: int


class FakeNVML:
    """The subset of the pynvml module that discovery uses, answering from recorded data."""

    NVMLError = NVMLError
    NVML_ERROR_NO_PERMISSION = NVML_ERROR_NO_PERMISSION
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST

    def __init__(self, rows=None, *, extra_processes: dict[int, list[int]] | None = None,
                 library_missing: bool = False, failing: dict[int, tuple[str, int]] | None = None,
                 names: list[str] | None = None):
        """``failing``: device index -> (the call that fails for it, NVML return code), as a GPU hidden by cgroups
        (nvmlDeviceGetHandleByIndex, NO_PERMISSION) or one lost (nvmlDeviceGetMemoryInfo, GPU_IS_LOST) answers.
        ``names``: a model name per device (a machine of mixed GPUs); the recorded A100 by default."""
        self.failing = dict(failing or {})
        self.names = names
        self.rows = [list(r) for r in (rows if rows is not None else RECORDED)]
        for index, pids in (extra_processes or {}).items():
            self.rows[index][3] = list(self.rows[index][3]) + [(pid, 1024) for pid in pids]
        self.library_missing = library_missing
        self.initialised = 0
        self.calls: list[str] = []

    def _check(self, name: str, index: int | None = None) -> None:
        self.calls.append(name)
        if self.initialised <= 0:
            raise NVMLError(1, "Uninitialized")
        call, code = self.failing.get(index, (None, 0))
        if call == name:
            raise NVMLError(code, ERROR_TEXT.get(code, f"NVML error {code}"))

    def nvmlInit(self):
        self.calls.append("nvmlInit")
        if self.library_missing:
            raise NVMLError(12, "NVML Shared Library Not Found")
        self.initialised += 1

    def nvmlShutdown(self):
        self._check("nvmlShutdown")
        self.initialised -= 1

    def nvmlSystemGetDriverVersion(self):
        self._check("nvmlSystemGetDriverVersion")
        return DRIVER

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return len(self.rows)

    def nvmlDeviceGetHandleByIndex(self, index: int):
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.rows):
            raise NVMLError(2, "Invalid Argument")
        return _Handle(index)

    def nvmlDeviceGetName(self, handle):
        self._check("nvmlDeviceGetName", handle.index)
        return self.names[handle.index] if self.names else NAME

    def nvmlDeviceGetUUID(self, handle):
        self._check("nvmlDeviceGetUUID", handle.index)
        return UUIDS[handle.index]

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._check("nvmlDeviceGetMemoryInfo", handle.index)
        used = self.rows[handle.index][1] * MiB
        return SimpleNamespace(total=TOTAL, used=used, free=TOTAL - used)

    def nvmlDeviceGetUtilizationRates(self, handle):
        self._check("nvmlDeviceGetUtilizationRates", handle.index)
        return SimpleNamespace(gpu=self.rows[handle.index][2], memory=self.rows[handle.index][2] // 2)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._check("nvmlDeviceGetComputeRunningProcesses", handle.index)
        return [SimpleNamespace(pid=pid, usedGpuMemory=used * MiB, gpuInstanceId=0xFFFFFFFF,
                                computeInstanceId=0xFFFFFFFF) for pid, used in self.rows[handle.index][3]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        self._check("nvmlDeviceGetGraphicsRunningProcesses")
        return []


def server8(**kwargs) -> FakeNVML:
    """The recorded 8-GPU server."""
    return FakeNVML(**kwargs)


def no_driver() -> FakeNVML:
    """A machine where nvidia-ml-py is installed but no NVIDIA driver is."""
    return FakeNVML(rows=[], library_missing=True)


def free2() -> FakeNVML:
    """A machine with two idle GPUs (the recorded server's freest two, renumbered 0 and 1)."""
    return FakeNVML(rows=[(0, 4, 2, []), (1, 4, 0, [])])
