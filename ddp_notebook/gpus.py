"""GPU discovery: which GPUs this kernel may use, and how busy they are.

NVML (nvidia-ml-py) answers without touching CUDA, so the kernel stays free to
launch ranks; torch.cuda is the fallback only when NVML is missing and torch is
already imported.  Indices are those the kernel sees: an existing
``CUDA_VISIBLE_DEVICES`` is respected, and ranks get the matching physical ids
with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so the GPU picked is the GPU used.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


@dataclass
class GPU:
    index: int  # as the kernel numbers it (relative to its CUDA_VISIBLE_DEVICES)
    name: str
    memory_used: int  # bytes
    memory_total: int
    utilization: int  # percent, -1 when unknown
    visible_id: str  # what goes into the ranks' CUDA_VISIBLE_DEVICES
    uuid: str = ""
    processes: list[int] = field(default_factory=list)  # pids

    @property
    def memory_free(self) -> int:
        return self.memory_total - self.memory_used


_nvml_override = None  # tests inject a recorded NVML module here


def _nvml():
    if _nvml_override is not None:
        return _nvml_override
    import pynvml  # from nvidia-ml-py

    return pynvml


def _visible_filter() -> list[str] | None:
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip() and v.strip() != "-1"]


def discover() -> list[GPU]:
    """The GPUs this kernel may use, numbered as CUDA numbers them here."""
    try:
        nvml = _nvml()
        nvml.nvmlInit()
    except Exception:
        return _discover_with_torch()
    try:
        found = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                util = -1
            try:
                procs = [p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)]
            except Exception:
                procs = []
            name = nvml.nvmlDeviceGetName(handle)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            found.append(GPU(
                index=i, name=name.decode() if isinstance(name, bytes) else name,
                memory_used=int(mem.used), memory_total=int(mem.total), utilization=util,
                visible_id=str(i), uuid=uuid.decode() if isinstance(uuid, bytes) else uuid, processes=procs,
            ))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    visible = _visible_filter()
    if visible is None:
        return found
    chosen = []
    for entry in visible:  # an index or a UUID (prefix), in the order given
        for gpu in found:
            if entry == str(gpu.index) or (entry.startswith("GPU-") and gpu.uuid.startswith(entry)):
                chosen.append(gpu)
                break
    for i, gpu in enumerate(chosen):
        gpu.visible_id = gpu.uuid if gpu.uuid else str(gpu.index)
        gpu.index = i
    return chosen


def _discover_with_torch() -> list[GPU]:
    torch = sys.modules.get("torch")
    if torch is None:
        # Without NVML and without torch already loaded: look for the driver
        # before paying for `import torch` in the notebook.
        if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/proc/driver/nvidia"):
            return []
        import torch
    if not torch.cuda.is_available():
        return []
    visible = _visible_filter()
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GPU(i, props.name, 0, int(props.total_memory), -1,
                        visible[i] if visible and i < len(visible) else str(i)))
    return gpus


def least_busy(gpus: list[GPU], n: int) -> list[GPU]:
    """The n GPUs with the most free memory, then the lowest utilisation."""
    return sorted(gpus, key=lambda g: (-g.memory_free, g.utilization, g.index))[:n]


def describe(gpus: list[GPU]) -> str:
    if not gpus:
        return "no GPUs"
    return ", ".join(f"{g.index}: {g.name} ({g.memory_used / 2**30:.1f}/{g.memory_total / 2**30:.0f} GiB used)" for g in gpus)
