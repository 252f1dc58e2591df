"""GPU discovery: which GPUs this kernel may use, how busy they are, and who runs on them.

NVML (nvidia-ml-py) answers without touching CUDA, so the kernel stays free to
launch ranks; torch.cuda is the fallback only when NVML itself is missing or
fails (a device NVML cannot read is skipped, with the reason, and the others
kept).  Indices are those the kernel sees: an existing ``CUDA_VISIBLE_DEVICES``
(indices or GPU UUIDs) is respected and numbered from 0 in its order; without
it, NVML's (nvidia-smi's) numbers.  Ranks get each GPU's UUID in their
``CUDA_VISIBLE_DEVICES`` (the physical index only where NVML gave no UUID, with
``CUDA_DEVICE_ORDER=PCI_BUS_ID``, NVML's order), so the GPU picked is the GPU
used whatever order CUDA numbers them in.  MIG instances are not used: a
``MIG-`` entry ends the list, and discovery says so (:attr:`Inventory.notes`).

No widget or IPython imports here: the terminal (``python -m ddp_notebook
gpus``) and the launcher use this module too.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from . import reservations

GiB = 2**30
WORKER_MODULES = ("ddp_notebook.rank.worker", "ddp_notebook.worker")  # (the second: ranks of earlier versions)
BUSY_UTILIZATION = 10  # percent
BUSY_MEMORY_FRACTION = 0.10


@dataclass
class GPUProcess:
    """A compute process on a GPU; ``rank`` is set when it is a rank of a ddp_notebook job."""

    pid: int
    memory_used: int | None = None  # bytes; None when the driver does not say
    name: str = ""  # its command line, where /proc shows it
    user: str = ""
    rank: int | None = None
    kernel_pid: int | None = None  # the notebook kernel that started the rank

    @property
    def ours(self) -> bool:
        return self.rank is not None


@dataclass
class GPU:
    index: int  # as the kernel numbers it (relative to its CUDA_VISIBLE_DEVICES)
    name: str
    memory_used: int  # bytes
    memory_total: int
    utilization: int  # percent, -1 when unknown
    visible_id: str  # what goes into the ranks' CUDA_VISIBLE_DEVICES
    uuid: str = ""
    processes: list[GPUProcess] = field(default_factory=list)
    physical_index: int | None = None  # NVML's (PCI bus order) index

    @property
    def memory_free(self) -> int:
        return self.memory_total - self.memory_used

    @property
    def lock_name(self) -> str:
        """The name of its reservation (engine/reservations.py): the same in every process of the machine."""
        return self.uuid or f"index-{self.index if self.physical_index is None else self.physical_index}"

    @property
    def busy(self) -> bool:
        """Worth leaving alone: a job of ours runs here, or memory or compute is in real use."""
        if self.our_ranks or self.utilization >= BUSY_UTILIZATION:
            return True
        return self.memory_total > 0 and self.memory_used / self.memory_total >= BUSY_MEMORY_FRACTION

    @property
    def our_ranks(self) -> list[GPUProcess]:
        """The ranks of ddp_notebook jobs (this or another notebook) running on this GPU."""
        return [p for p in self.processes if p.ours]

    @property
    def other_processes(self) -> list[GPUProcess]:
        return [p for p in self.processes if not p.ours]

    def load_text(self) -> str:
        """Memory and utilisation in a few words: ``71.2/80 GiB, 97%``."""
        util = f"{self.utilization}%" if self.utilization >= 0 else "util ?"
        if self.memory_total <= 0:
            return util
        return f"{self.memory_used / GiB:.1f}/{self.memory_total / GiB:.0f} GiB, {util}"

    def jobs_text(self) -> str:
        """Who runs here: our jobs by kernel, then other processes."""
        parts = []
        me = os.getpid()
        by_kernel: dict[int | None, list[int]] = {}
        for proc in self.our_ranks:
            by_kernel.setdefault(proc.kernel_pid, []).append(proc.rank)
        for kernel, ranks in sorted(by_kernel.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
            who = "this notebook" if kernel == me else (f"notebook pid {kernel}" if kernel else "a notebook")
            numbers = ", ".join(str(r) if r >= 0 else "?" for r in sorted(ranks))
            parts.append(f"ddp_notebook job of {who} (rank{'s' if len(ranks) > 1 else ''} {numbers})")
        others = self.other_processes
        if others:
            parts.append(f"{len(others)} other process{'es' if len(others) != 1 else ''}")
            seen = [f"{p.user or '?'}: {_short(p.name)}" for p in others if p.name]
            if seen:
                parts[-1] += f" ({', '.join(seen[:3])}{', ...' if len(seen) > 3 else ''})"
        elif not parts and self.memory_total and self.memory_used / self.memory_total >= BUSY_MEMORY_FRACTION:
            # NVML lists no process, yet memory is in use: processes of other containers, invisible from here
            return "in use by processes this machine cannot see (another container?)"
        return "; ".join(parts) if parts else "idle"


class Inventory(list):
    """The GPUs discovery found (a list of :class:`GPU`), and in ``notes`` what a user should know about the rest:
    devices NVML could not read, ``CUDA_VISIBLE_DEVICES`` entries not used, numbering that may differ from CUDA's."""

    def __init__(self, gpus=(), notes=()):
        super().__init__(gpus)
        self.notes: list[str] = list(notes)


def _short(command: str, width: int = 40) -> str:
    return command if len(command) <= width else command[:width - 1] + "…"


_nvml_override = None  # tests inject a recorded NVML module here


def _nvml():
    if _nvml_override is not None:
        return _nvml_override
    import pynvml  # from nvidia-ml-py

    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible_entries() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES split into entries; None when it is not set."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return [v.strip() for v in value.split(",")]


def _apply_visible(found: list[GPU], entries: list[str] | None, notes: list[str] | None = None) -> list[GPU]:
    """The GPUs CUDA shows under ``CUDA_VISIBLE_DEVICES``, renumbered from 0; ``notes`` gets what was not used.

    As CUDA does: entries are physical indices or (prefixes of) ``GPU-`` UUIDs,
    and the list ends at the first entry that names no GPU (so ``-1`` or an
    empty value hides every GPU).  A ``MIG-`` entry (a MIG instance) ends it
    too, and is named in ``notes``: ranks run on whole GPUs only.
    """
    notes = [] if notes is None else notes
    order_by_speed = os.environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST") != "PCI_BUS_ID"
    mixed_models = len({g.name for g in found}) > 1
    if entries is None:
        if order_by_speed and mixed_models:
            notes.append("GPU numbers here are nvidia-smi's (PCI bus order); this kernel's torch.cuda numbers these "
                         "different GPU models fastest first (CUDA_DEVICE_ORDER is not PCI_BUS_ID), so its cuda:N "
                         "may be another GPU (ranks get GPU UUIDs: the GPU picked here is the GPU used)")
        return found
    chosen: list[GPU] = []
    for entry in entries:
        match = None
        if entry.upper().startswith("MIG-"):
            notes.append(f"CUDA_VISIBLE_DEVICES names a MIG instance, {entry}: ddp_notebook runs ranks on whole "
                         f"GPUs only (one CUDA process sees one MIG instance, and NCCL does not join instances), so "
                         f"it and the entries after it are not used")
            break
        if entry.isdigit():
            match = next((g for g in found if g.physical_index == int(entry)), None)
        elif entry.startswith("GPU-") and len(entry) > 4:
            matches = [g for g in found if g.uuid.startswith(entry)]
            match = matches[0] if len(matches) == 1 else None
        if match is None or match in chosen:
            break
        chosen.append(match)
    if order_by_speed and mixed_models and any(e.isdigit() for e in entries[:len(chosen)]):
        notes.append(f"CUDA_VISIBLE_DEVICES={','.join(entries)} gives indices, which CUDA counts fastest first "
                     f"(CUDA_DEVICE_ORDER is not PCI_BUS_ID) and this machine has different GPU models: they were "
                     f"read in PCI bus order (nvidia-smi's) and may name other GPUs than this kernel's CUDA uses; "
                     f"set CUDA_DEVICE_ORDER=PCI_BUS_ID, or give GPU UUIDs")
    for i, gpu in enumerate(chosen):
        gpu.index = i
    return chosen


def _rank_of(pid: int) -> tuple[int, int | None] | None:
    """(rank, kernel pid) when ``pid`` is a rank of a ddp_notebook job (or a process it started), else None.

    Looked up by pid only, with psutil: a rank runs ``python -m ddp_notebook.rank.worker``
    and carries ``DDP_NOTEBOOK_RANK`` in its environment.
    """
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is a dependency
        return None
    try:
        proc = psutil.Process(pid)
        for _ in range(4):  # the rank itself, or a DataLoader worker under it
            cmdline = proc.cmdline()
            if "-m" in cmdline and any(module in cmdline for module in WORKER_MODULES):
                rank = None
                try:
                    rank = proc.environ().get("DDP_NOTEBOOK_RANK")
                except psutil.Error:
                    pass  # another user's process: its cmdline still tells us
                parent = proc.ppid()
                return (int(rank) if rank and rank.isdigit() else -1, parent if parent > 1 else None)
            proc = proc.parent()
            if proc is None:
                return None
    except (psutil.Error, OSError, ValueError):
        return None
    return None


def _process_owner_and_command(pid: int) -> tuple[str, str]:
    """(user, command line) of ``pid`` as far as /proc shows them; ("", "") for a pid of another container."""
    try:
        import psutil

        proc = psutil.Process(pid)
        try:
            command = " ".join(proc.cmdline()) or proc.name()
        except psutil.Error:
            command = proc.name()
        try:
            user = proc.username()
        except (psutil.Error, KeyError):
            user = ""
        return user, command
    except Exception:
        return "", ""  # a pid of another container, or gone


def _processes(nvml, handle) -> list[GPUProcess]:
    found: dict[int, GPUProcess] = {}
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            entries = getattr(nvml, getter)(handle)
        except Exception:
            continue
        for entry in entries:
            pid = int(entry.pid)
            if pid in found:
                continue
            used = getattr(entry, "usedGpuMemory", None)
            proc = GPUProcess(pid, int(used) if isinstance(used, int) and used >= 0 else None)
            ours = _rank_of(pid)
            if ours is not None:
                proc.rank, proc.kernel_pid = ours
            proc.user, proc.name = _process_owner_and_command(pid)
            found[pid] = proc
    return list(found.values())


def _discover_with_nvml(nvml) -> tuple[list[GPU], str, list[str]]:
    """Every GPU NVML can read; one it cannot (no permission: a GPU hidden by cgroups; a GPU lost) is skipped and
    named in the notes, and the others are kept.  Raises only when NVML itself fails (init, the device count)."""
    nvml.nvmlInit()
    skipped = []
    try:
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            driver = "?"
        found = []
        for i in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                name = _text(nvml.nvmlDeviceGetName(handle))
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception as exc:  # NVMLError: NO_PERMISSION, GPU_IS_LOST, ...
                skipped.append(f"GPU {i} skipped: NVML: {_text(exc) or type(exc).__name__}")
                continue
            try:
                util = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:
                util = -1
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            except Exception:
                uuid = ""
            found.append(GPU(
                index=i, name=name, memory_used=int(mem.used), memory_total=int(mem.total), utilization=util,
                # The UUID is exact whatever order CUDA numbers GPUs in; the index only with PCI_BUS_ID.
                visible_id=uuid or str(i), uuid=uuid, processes=_processes(nvml, handle), physical_index=i,
            ))
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return found, f"NVML, driver {driver}", skipped


def discover_report() -> tuple[Inventory, str]:
    """The GPUs this kernel may use, and where the answer came from (or why there is none), with the notes."""
    try:
        nvml = _nvml()
    except ImportError:
        nvml, nvml_error = None, "nvidia-ml-py is not installed"
    if nvml is not None:
        try:
            found, source, notes = _discover_with_nvml(nvml)
        except Exception as exc:  # no driver, no library, no permission
            nvml_error = f"NVML: {_text(exc) or type(exc).__name__}"
        else:
            entries = _visible_entries()
            found = _apply_visible(found, entries, notes)
            if entries is not None:
                source += f"; CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}"
            return Inventory(found, notes), "; ".join([source] + notes)
    return _discover_with_torch(nvml_error)


def discover() -> Inventory:
    """The GPUs this kernel may use, numbered as CUDA numbers them here (``.notes``: what else to know)."""
    return discover_report()[0]


def _discover_with_torch(why_not_nvml: str) -> tuple[Inventory, str]:
    torch = sys.modules.get("torch")
    if torch is None:
        # Without NVML and without torch already loaded: look for the driver
        # before paying for `import torch` in the notebook.
        if not os.path.exists("/dev/nvidiactl") and not os.path.exists("/proc/driver/nvidia"):
            return Inventory(), f"no NVIDIA driver ({why_not_nvml})"
        import torch
    if not torch.cuda.is_available():
        return Inventory(), f"torch.cuda sees no GPU ({why_not_nvml})"
    entries = _visible_entries()
    gpus, notes = Inventory(), []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        entry = entries[i] if entries and i < len(entries) else ""
        uuid = str(getattr(props, "uuid", "") or "")
        if entry.upper().startswith("MIG-"):
            uuid = entry  # a MIG instance: its own UUID, never GPU-...
            notes.append(f"GPU {i} is a MIG instance ({entry}): one rank at most (NCCL does not join instances)")
        elif uuid and not uuid.startswith(("GPU-", "MIG-")):
            uuid = f"GPU-{uuid}"
        # The UUID is exact; an index entry of the kernel's could be counted in another order than the ranks'.
        visible = entry if uuid == entry else (uuid or entry or str(i))
        gpus.append(GPU(i, props.name, 0, int(props.total_memory), -1, visible, uuid))
    gpus.notes = notes
    return gpus, "; ".join([f"torch.cuda, no load readings ({why_not_nvml})"] + notes)


def least_busy(gpus: list[GPU], n: int) -> list[GPU]:
    """The n GPUs with the most free memory, then the lowest utilisation."""
    return sorted(gpus, key=lambda g: (-g.memory_free, max(g.utilization, 0), g.index))[:n]


def describe(gpus: list[GPU]) -> str:
    """One line for messages: ``0: NVIDIA A100 (71.2/80 GiB, 97%), 1: ...``."""
    if not gpus:
        notes = getattr(gpus, "notes", [])
        return f"no GPUs ({'; '.join(notes)})" if notes else "no GPUs"
    return ", ".join(f"{g.index}: {g.name} ({g.load_text()})" for g in gpus)


def table(gpus: list[GPU], source: str = "") -> str:
    """The GPUs as a text table, as ``python -m ddp_notebook gpus`` prints it."""
    lines = []
    if source:
        lines.append(f"GPUs ({source}):" if gpus else f"No GPU found: {source}.")
    if not gpus:
        lines.append("%%ddp cells run CPU ranks with the gloo backend (--cpus N; 2 by default).")
        return "\n".join(lines)
    held = reservations.holders([g.lock_name for g in gpus])
    rows = [("GPU", "name", "memory used", "util", "free", "reservation; processes")]
    for g in gpus:
        mem = f"{g.memory_used / GiB:.1f}/{g.memory_total / GiB:.0f} GiB" if g.memory_total else "?"
        util = f"{g.utilization}%" if g.utilization >= 0 else "?"
        free = f"{g.memory_free / GiB:.1f} GiB" if g.memory_total else "?"
        holder = held[g.lock_name]
        reserved = f"reserved by {holder.describe()}; " if holder else ""
        rows.append((str(g.index), g.name, mem, util, free, reserved + g.jobs_text()))
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    for row in rows:
        cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                 row[3].rjust(widths[3]), row[4].rjust(widths[4]), row[5]]
        lines.append("  ".join(cells).rstrip())
    busy = [g.index for g in gpus if g.our_ranks]
    if busy:
        lines.append(f"GPU {', '.join(map(str, busy))} already run a ddp_notebook job.")
    order = ", ".join(str(g.index) for g in least_busy(gpus, len(gpus)))
    lines.append(f"least busy first: {order}  (--gpus N takes the first N that no other job has reserved)")
    return "\n".join(lines)
