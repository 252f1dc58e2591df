"""What a job asks for: its devices, its options and its master port, checked before anything starts.

One place for the rules the magic and ``launch()`` share: ``--gpus`` parsing,
device choice, option checks and binding the master port.
"""
from __future__ import annotations

import errno
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..wire.errors import LaunchError
from . import devices as gpu_discovery
from . import reservations

DEFAULT_CPU_RANKS = 2
# What chooses the devices of cells and launches that name none: the GPU picker. Explicit flags win, and a
# warm pool, which runs such cells itself, wins over it.
_default_devices: Callable[[], tuple[str, Any] | None] | None = None


def set_default_devices(fn: Callable[[], tuple[str, Any] | None] | None) -> None:
    """Install (or, with None, remove) what chooses the devices of cells and launches that name none.

    ``fn()`` returns ``("gpus", [indices])``, ``("cpus", n)`` or None (no opinion).
    """
    global _default_devices
    _default_devices = fn



@dataclass
class JobSpec:
    """Where and how the ranks run."""

    world_size: int
    gpus: list[str] | None = None  # CUDA_VISIBLE_DEVICES entries; None for CPU ranks
    backend: str = "gloo"
    port: int | None = None
    seed: int | None = None
    timeout: float | None = None  # per collective, passed to init_process_group
    startup_timeout: float = 120.0
    init_group: bool = True
    output_ranks: set[int] | None = None  # None: every rank's output
    master_addr: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # told to the user at start
    nnodes: int = 1  # > 1: this host is node 0 of a job on several hosts (nodes.py); world_size counts them all
    export_path: str | None = None  # the script the other hosts run under torchrun (nnodes > 1)
    executor: Any = None  # a submitit executor: the ranks are the tasks of a Slurm job (slurm.py)
    # The GPUs held for this job against every other on the machine (reservations.py); the job or pool releases it.
    reservation: Any = field(default=None, repr=False, compare=False)
    # Node 0's store port of a job on several hosts, bound since it was checked, until torchrun's agent takes it
    # over (multinode.py): it is never free for another user to take.
    master_socket: Any = field(default=None, repr=False, compare=False)

    def release_devices(self) -> None:
        """Let other jobs have the GPUs (and the master port) held for this job (it ended, or will not run)."""
        if self.reservation is not None:
            self.reservation.release()
        if self.master_socket is not None:
            self.master_socket.close()
    chosen_backend: str | None = None  # with an executor, the backend asked for (None: each rank chooses)


def parse_gpus(gpus: Any) -> int | list[int]:
    """``--gpus`` / ``gpus=``: a count, or a list of indices (``"0,2"``, ``[0, 2]``, ``"3,"``)."""
    if isinstance(gpus, bool):
        raise LaunchError(f"gpus must be a count or a list of indices, not {gpus!r}")
    if isinstance(gpus, int):
        return gpus
    if isinstance(gpus, str):
        text = gpus.strip()
        if "," not in text:
            try:
                return int(text)
            except ValueError:
                raise LaunchError(f"--gpus {gpus!r}: give a count (2) or indices (0,2,5; one index is written 3,)") from None
        try:
            return [int(p) for p in text.split(",") if p.strip()]
        except ValueError:
            raise LaunchError(f"--gpus {gpus!r}: indices must be integers, as in 0,2,5") from None
    return [int(i) for i in gpus]


WAIT_POLL_S = 1.0  # how often --wait looks again


def resolve_devices(gpus: Any = None, cpus: int | None = None, backend: str | None = None, *,
                    force: bool = False, wait: float | None = None, port: int | None = None,
                    seed: int | None = None, timeout: float | None = None,
                    output_ranks: set[int] | None = None) -> JobSpec:
    """Turn the user's device request into a spec, or refuse it before anything starts.  GPUs are reserved
    against every other ddp_notebook job on the machine (``spec.reservation``); ``force`` shares a GPU named
    explicitly although another job holds it; ``wait`` (minutes, ``math.inf``: no limit) waits for a count of
    GPUs to be free of reservations and load, first come first served.  The other options go into the spec."""
    spec = _devices(gpus, cpus, backend, force=force, wait=wait)
    spec.port, spec.seed, spec.timeout, spec.output_ranks = port, seed, timeout, output_ranks
    return spec


def _devices(gpus: Any, cpus: int | None, backend: str | None, *, force: bool, wait: float | None) -> JobSpec:
    if gpus is not None and cpus is not None:
        raise LaunchError("give either gpus or cpus, not both")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
    notes: list[str] = []
    if gpus is None and cpus is None and _default_devices is not None:
        chosen = _default_devices()
        if chosen is not None:
            kind, value = chosen
            gpus, cpus = (value, None) if kind == "gpus" else (None, value)
            notes.append(f"using the {kind} chosen in the GPU picker: {value}")
    if cpus is not None:
        if wait is not None:
            raise LaunchError("--wait waits for GPUs (--gpus N); CPU ranks need no waiting")
        if not isinstance(cpus, int) or isinstance(cpus, bool) or cpus < 1:
            raise LaunchError(f"cpus must be a positive number of ranks, not {cpus!r}")
        if backend == "nccl":
            raise LaunchError("the nccl backend needs GPUs; CPU ranks use gloo")
        return JobSpec(world_size=cpus, backend="gloo", notes=notes)
    available = gpu_discovery.discover()
    unused = getattr(available, "notes", [])  # GPUs skipped or not used, and why
    notes.extend(unused)
    reservation = None
    if gpus is None:
        if not available:
            if backend == "nccl":
                raise LaunchError(f"the nccl backend needs GPUs, and this machine has none"
                                  f"{': ' + '; '.join(unused) if unused else ''}")
            if unused:
                notes.append(f"no GPU to use: running {DEFAULT_CPU_RANKS} CPU ranks (gloo)")
            return JobSpec(world_size=DEFAULT_CPU_RANKS, backend="gloo", notes=notes)
        chosen_gpus, reservation = _reserve_count(available, None, notes)
    else:
        request = parse_gpus(gpus)
        if isinstance(request, int):
            if request < 1:
                raise LaunchError(f"gpus must be at least 1, not {request}")
            if request > len(available):
                raise LaunchError(f"{request} GPUs asked for, but this machine has {len(available)}: "
                                  f"{gpu_discovery.describe(available)}")
            if wait is not None:
                available, reservation = _wait_for_gpus(request, wait)
                chosen_gpus = sorted((g for g in available if g.lock_name in reservation.uuids), key=lambda g: g.index)
            else:
                chosen_gpus, reservation = _reserve_count(available, request, notes)
        else:
            if not request:
                raise LaunchError("--gpus: no GPU index given")
            if len(set(request)) != len(request):
                raise LaunchError(f"--gpus lists a GPU twice: {request}")
            by_index = {g.index: g for g in available}
            unknown = [i for i in request if i not in by_index]
            if unknown:
                raise LaunchError(f"GPU {', '.join(map(str, unknown))} not found; this machine has "
                                  f"{len(available)}: {gpu_discovery.describe(available)}")
            if wait is not None:
                raise LaunchError("--wait waits for a count of GPUs (--gpus N), not for GPUs named by index")
            chosen_gpus = [by_index[i] for i in request]
            reservation = _reserve_named(chosen_gpus, force, notes)
    shared = [g for g in chosen_gpus if g.our_ranks]
    if shared:
        notes.append("already running a ddp_notebook job: "
                     + "; ".join(f"GPU {g.index}: {g.jobs_text()}" for g in shared))
    return JobSpec(world_size=len(chosen_gpus), gpus=[g.visible_id for g in chosen_gpus],
                   backend=backend or "nccl", notes=notes, reservation=reservation)


def _reserve_count(available: list, n: int | None, notes: list[str]):
    """The ``n`` least busy GPUs no other job holds (None: every free one), held for this job: (GPUs, reservation).
    The locks decide: two kernels choosing at the same moment get different GPUs."""
    held = reservations.holders([g.lock_name for g in available])
    free = [g for g in available if held[g.lock_name] is None]
    taken = [g for g in available if held[g.lock_name] is not None]
    want = len(free) if n is None else n
    reservation = reservations.reserve_any([g.lock_name for g in gpu_discovery.least_busy(free, len(free))], want) \
        if want else None
    if reservation is None:
        others = "; ".join(f"GPU {g.index}: {held[g.lock_name].describe()}" for g in taken) or "none"
        raise LaunchError(f"{want or 'some'} GPU{'s' if want != 1 else ''} asked for, but only {len(free)} of "
                          f"{len(available)} are free of other jobs' reservations (reserved: {others}); wait for "
                          f"them with --wait, or share one with --gpus INDEX --force")
    chosen = sorted((g for g in available if g.lock_name in reservation.uuids), key=lambda g: g.index)
    if n is not None and n < len(available):
        notes.append(f"using the {n} least busy GPUs free of other jobs: "
                     + ", ".join(f"{g.index} ({g.load_text()})" for g in chosen))
    elif n is None and taken:
        notes.append(f"using the {len(chosen)} GPUs no other job holds; reserved: "
                     + "; ".join(f"GPU {g.index}: {held[g.lock_name].describe()}" for g in taken))
    return chosen, reservation


def _wait_for_gpus(n: int, minutes: float):
    """Wait until ``n`` GPUs are free of reservations and not busy, and hold them: (every GPU, reservation).
    A status line counts the time; an interrupt ends the wait."""
    started = time.monotonic()
    try:
        return _wait_in_line(n, minutes, started)
    except BaseException:
        print(file=sys.stderr)  # end the status line
        raise


def _wait_in_line(n: int, minutes: float, started: float):
    with reservations.WaitingLine() as line:
        while True:
            available = gpu_discovery.discover()
            held = reservations.holders([g.lock_name for g in available])
            usable = [g for g in available if held[g.lock_name] is None and not g.busy]
            my_turn = line.my_turn()  # also says who is ahead in line, for the status line
            if len(usable) >= n and my_turn:
                ranked = gpu_discovery.least_busy(usable, len(usable))
                reservation = reservations.reserve_any([g.lock_name for g in ranked], n)
                if reservation is not None:
                    print(f"\rGPUs free after {_clock(time.monotonic() - started)}: "
                          f"{', '.join(str(g.index) for g in available if g.lock_name in reservation.uuids)}",
                          file=sys.stderr, flush=True)
                    return available, reservation
            waited = time.monotonic() - started
            ahead = f"; ahead in line: {line.ahead.describe()}" if line.ahead else ""
            if waited > minutes * 60:
                by_holder: dict[str, list[str]] = {}
                for g in available:
                    if held[g.lock_name] is not None:
                        by_holder.setdefault(held[g.lock_name].describe(), []).append(str(g.index))
                reserved = "; ".join(f"GPU {', '.join(indices)}: {who}" for who, indices in by_holder.items())
                raise LaunchError(f"{n} GPU{'s' if n != 1 else ''} did not become free within {minutes:g} min "
                                  f"({len(available) - len(usable)} of {len(available)} busy or reserved"
                                  + (f"; reserved: {reserved}" if reserved else "") + f"{ahead})")
            print(f"\rwaiting for {n} GPU{'s' if n != 1 else ''}: {len(available) - len(usable)} busy{ahead} — "
                  f"{_clock(waited)}", end="", file=sys.stderr, flush=True)
            time.sleep(WAIT_POLL_S)


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _reserve_named(chosen: list, force: bool, notes: list[str]):
    """Hold the GPUs the user named.  One that another kernel's job holds is refused unless ``force``; one that
    a job of this kernel holds is shared (the user's own choice), with a note."""
    reservation, holders = reservations.reserve([g.lock_name for g in chosen])
    others = [g for g in chosen if g.lock_name in holders and holders[g.lock_name].pid != os.getpid()]
    mine = [g for g in chosen if g.lock_name in holders and holders[g.lock_name].pid == os.getpid()]
    if others and not force:
        reservation.release()
        busy = "; ".join(f"GPU {g.index} is reserved by {holders[g.lock_name].describe()}" for g in others)
        raise LaunchError(f"{busy}. Choose others (%ddp_gpus shows who holds which), wait with --gpus N --wait, "
                          f"or share it anyway with --force")
    if others:
        notes.append("sharing with another kernel's job (--force): "
                     + "; ".join(f"GPU {g.index}: {holders[g.lock_name].describe()}" for g in others))
    if mine:
        notes.append(f"GPU{'s' if len(mine) > 1 else ''} {', '.join(str(g.index) for g in mine)} also held by "
                     f"another job of this notebook")
    return reservation


def call_arguments(call: str, args: Any, kwargs: Any = None) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of ``launch``/``spawn`` as a tuple and a dict, or a :class:`LaunchError` that says how
    to write them, before any rank starts: ``args=("data.csv")`` is a string, which would reach ``fn`` as one
    argument a character, and ``args=4`` (``mp.spawn``'s ``nprocs`` in the wrong place) is no sequence at all."""
    if not isinstance(args, (tuple, list)):
        raise LaunchError(f"{call}(args=...) takes a tuple of fn's positional arguments, not {type(args).__name__} "
                          f"{args!r:.60}: for one argument write args=({args!r:.60},)")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(name, str) for name in kwargs)):
        raise LaunchError(f"{call}(kwargs=...) takes a dict of fn's keyword arguments by name, not "
                          f"{type(kwargs).__name__} {kwargs!r:.60}")
    return tuple(args), dict(kwargs or {})


def check_options(port: Any = None, seed: Any = None, timeout: Any = None, startup_timeout: Any = None, *,
                  max_restarts: Any = 0, nnodes: int = 1, hang_after: Any = None, log_dir: Any = None) -> None:
    """Refuse malformed job options before anything starts."""
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be a non-negative integer, not {max_restarts!r}")
    if max_restarts and nnodes != 1:
        raise LaunchError("restarts of a job on several hosts are torchrun's: run the export with "
                          "torchrun --max-restarts N (ddp_notebook.attempt() counts them there too)")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535):
        raise LaunchError(f"port must be between 1 and 65535, not {port!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or seed < 0):
        raise LaunchError(f"seed must be a non-negative integer, not {seed!r}")
    for name, value in (("timeout", timeout), ("startup_timeout", startup_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
            raise LaunchError(f"{name} must be a positive number of seconds, not {value!r}")
    if hang_after is not None and (isinstance(hang_after, bool) or not isinstance(hang_after, (int, float))
                                   or not hang_after >= 0):
        raise LaunchError(f"hang_after must be a positive number of seconds (0 or None: never), not {hang_after!r}")
    if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
        raise LaunchError(f"log_dir must be a folder's path, not {type(log_dir).__name__} {log_dir!r:.60}")


def check_together(*, debug: bool, detach: bool, executor: Any, nnodes: int, flag: Callable[[str], str]) -> None:
    """Refuse options that do not go together, before anything starts; the one rule for ``%%ddp`` and
    ``launch()``, in each one's words: ``flag(name)`` spells an option as its caller does ("--debug" for the magic,
    "debug=True" for ``launch()``)."""
    if detach and executor is None:
        raise LaunchError(f"{flag('detach')} leaves a Slurm job running on its own: it goes with {flag('executor')}")
    if debug and (executor is not None or nnodes > 1):
        raise LaunchError(f"{flag('debug')} keeps a failing rank of this host for %ddp_debug; the ranks of a job on "
                          f"several hosts ({flag('nnodes')}) or of a Slurm job ({flag('executor')}) end with their "
                          f"task")


def bind_port(addr: str, port: int | None) -> socket.socket:
    """A listening socket for rank 0's TCPStore: the port is never free for anyone else to take."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port or 0))
        sock.listen(512)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise LaunchError(f"port {port} is already in use on {addr}; pick another or leave --port out "
                              f"for a free one. No rank was started.") from None
        raise
    return sock


def free_port(addr: str) -> int:
    """A port free on ``addr`` now (for ranks that bind it themselves)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]
