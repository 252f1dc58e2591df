"""Large tensors and arrays reach the ranks through shared memory, not inside the payload.

Notebook side: the payload's pickler asks a :class:`Store` about every object it
meets.  A ``torch.Tensor`` or ``numpy.ndarray`` of at least
``DDP_NOTEBOOK_SHARE_MIN_BYTES`` (1 MiB) becomes a small reference to a shared
buffer, wherever it sits (a TensorDataset, a dict, a Dataset's attribute, a
function argument, a model's parameters).  The buffer is written once per dump;
tensors and views over one storage share one buffer.  So does every buffer of that
size of a pyarrow Table or Array (a Hugging Face ``datasets.Dataset`` in memory, a
pandas column of Arrow type), and every buffer of at least ``ARROW_PART_MIN_BYTES``
of one that holds ``min_bytes`` in all: copied once (Arrow's allocator is not
glibc's, so never moved), wrapped again in the rank without a copy of its own.

* Moved in place: when the data is a heap block of its own (glibc gives every
  large allocation its own mapping), its pages are moved into a memfd, chunk by
  chunk, and mapped back at the same address.  Every alias (views, ``.numpy()``)
  keeps working, no second copy exists at any moment, and the next job shares
  the same pages again without copying.  The move runs on a thread while the
  ranks start (they wait for the file to be complete), so only while the
  notebook waits for the job: a write landing between the copy of a chunk and
  its mapping would be lost.  Jobs that run beside the notebook copy instead
  (``Store(move=False)``), and ``Bundle.release`` waits for the moves it started.
  A fork of the notebook maps moved blocks copy-on-write (see
  ``_after_fork_in_child``): its writes stay its own.
* Copied: anything else (views of a small part of a storage, pinned or GPU
  tensors, arrays whose memory belongs to someone else) is copied into one
  per-dump memfd, or, when the machine cannot spare the memory
  (``DDP_NOTEBOOK_SHM_LIMIT`` bytes, default what MemAvailable and the cgroup
  allow), into an unlinked file in the temp directory.

Nothing is ever named in ``/dev/shm`` or on disk: memfds and unlinked files
vanish with their last descriptor and mapping, so neither a finished job, an
interrupt nor a SIGKILLed kernel leaves anything behind, and a small ``/dev/shm``
(64 MB in many containers) is never involved.  Every page is written (or
reserved with ``fallocate``) before anything maps it, so a full disk or memory
limit is an error of a system call (the array is then copied, or pickled the
ordinary way), never SIGBUS.

Rank side: the ranks open the notebook's descriptor through
``/proc/<notebook pid>/fd/<n>`` and map it ``MAP_PRIVATE``: pages are shared
until a rank writes to them, a rank's writes stay its own, and the notebook's
objects keep their values.  dtype, shape, strides, ``requires_grad`` and
aliasing between tensors of one storage are kept; CUDA tensors travel through
CPU memory and land on the rank's own GPU.

Results, the other way: the notebook makes an empty memfd for each rank of a job (:func:`results_file`) and
names it in the task's message; a rank of the notebook's host copies the big tensors and arrays of what it returns
into it through ``/proc/<notebook pid>/fd/<n>`` (``Store(results_into=...)``, never moved: the rank's model goes on
changing) and sends references to it.  The notebook maps them as it reads the result, so it holds one copy of the
values, in the memfd's pages, and never a pickled one.  The file is the notebook's own from the start, so a rank
may end the moment it has sent its result; the notebook closes it when the job ends (its mappings keep the pages
the result uses).

``DDP_NOTEBOOK_SHARE_INPLACE=0`` copies instead of moving notebook memory;
``DDP_NOTEBOOK_SHARE_MIN_BYTES=off`` pickles everything the ordinary way.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import tempfile
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any

DEFAULT_MIN_BYTES = 1 << 20
ARROW_PART_MIN_BYTES = 4096  # the buffers of an Arrow table or array of at least min_bytes shared down to this size
_PAGE = mmap.PAGESIZE
_CHUNK = 16 << 20  # moved per step: the most held twice at any moment, and the GIL held at a time
_DISK_MARGIN = 256 << 20
ALIGN = 4096  # of copies inside a shared file
EXPORT_REF = "ddp_notebook-export"  # stands where a shared buffer's device id would be, in an export's references
_MAP_FIXED = 0x10
_FOREIGN_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")


def min_bytes() -> int | None:
    """Arrays of at least this many bytes are shared; None: sharing is off."""
    text = os.environ.get("DDP_NOTEBOOK_SHARE_MIN_BYTES", "").strip().lower()
    if not text:
        return DEFAULT_MIN_BYTES
    if text in ("off", "none", "inf", "never"):
        return None
    return max(1, int(float(text)))


def _proc_fds_usable() -> bool:
    return os.path.isdir(f"/proc/{os.getpid()}/fd")


# -- what the notebook process holds -------------------------------------------------------------


class Bundle:
    """The shared files of one payload: descriptors the ranks open, closed by ``release()``."""

    def __init__(self) -> None:
        self._fds: list[int] = []
        self._moves: list[threading.Event] = []
        self.stats = {"moved": 0, "memory": 0, "disk": 0, "inline": 0, "arrays": 0}  # bytes, and a count
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    @property
    def fds(self) -> tuple[int, ...]:
        return tuple(self._fds)

    def adopt(self, fd: int) -> None:
        """Close ``fd`` with this bundle."""
        self._fds.append(fd)

    def _track_move(self, done: threading.Event) -> None:
        self._moves.append(done)

    def release(self) -> None:
        """Close this payload's descriptors (idempotent); ranks that mapped the data keep their mappings.

        Returns only once every move this payload started is finished, even when
        interrupted: a write the notebook makes while a block is half moved would be lost.
        """
        interrupted = False
        for done in self._moves:
            while not done.is_set():
                try:
                    done.wait(0.1)
                except KeyboardInterrupt:
                    interrupted = True
        self._moves.clear()
        self._finalizer()
        if interrupted:
            raise KeyboardInterrupt


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


class _Moved:
    """A notebook allocation whose pages now live in a memfd mapped back over it (MAP_SHARED)."""

    def __init__(self, fd: int, addr: int, nbytes: int, base: int, lo: int, hi: int, size: int):
        self.fd, self.addr, self.nbytes = fd, addr, nbytes
        self.base, self.lo, self.hi = base, lo, hi  # file offset 0 is address `base`; [lo, hi) is mapped so far
        self.size = size  # of the file once every byte is in: ranks wait for it
        st = os.fstat(fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        self.complete = False
        self.failed = False
        self.done = threading.Event()
        self.owner: Any = None  # weakref to the object whose life bounds the allocation's

    @property
    def head(self) -> int:
        return self.addr - self.base


_moved: dict[int, _Moved] = {}  # allocation address -> its memfd
_moved_lock = threading.Lock()


def _forget(addr: int, rec: _Moved) -> None:
    """The owner is gone, and with it the allocation: let the memfd go too."""
    with _moved_lock:
        if _moved.get(addr) is rec:
            del _moved[addr]
            try:
                os.close(rec.fd)
            except OSError:
                pass


def _after_fork_in_child() -> None:
    # The notebook maps moved pages MAP_SHARED; a forked child (a DataLoader worker
    # in the notebook, a fork-based launcher) expects copy-on-write pages of its own.
    if not _moved:
        return
    lib = _libc()
    for rec in list(_moved.values()):
        if rec.hi > rec.lo:
            lib.mmap(rec.lo, rec.hi - rec.lo, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED,
                     rec.fd, rec.lo - rec.base)
        try:
            os.close(rec.fd)
        except OSError:
            pass
    _moved.clear()  # the child's pages are its own now: it shares them again by copying


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)

_lib = None


def _libc():
    """libc through PyDLL: the GIL stays held, so no Python thread sees a region half moved."""
    global _lib
    if _lib is None:
        lib = ctypes.PyDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.pwrite.restype = ctypes.c_ssize_t
        lib.pwrite.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
        _lib = lib
    return _lib


def write_at(fd: int, addr: int, nbytes: int, offset: int) -> None:
    """Write ``nbytes`` of this process's memory at ``addr`` to ``fd`` at ``offset``, all of it."""
    lib = _libc()
    while nbytes > 0:
        done = lib.pwrite(fd, addr, min(nbytes, 1 << 30), offset)
        if done <= 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        addr, nbytes, offset = addr + done, nbytes - done, offset + done


def _can_move() -> bool:
    return (os.environ.get("DDP_NOTEBOOK_SHARE_INPLACE", "1").strip() not in ("0", "false", "no", "off")
            and sys.platform.startswith("linux") and platform.machine() in ("x86_64", "aarch64")
            and hasattr(os, "memfd_create") and ctypes.sizeof(ctypes.c_void_p) == 8
            and (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"))


class _Maps:
    """This process's memory mappings (/proc/self/maps)."""

    def __init__(self) -> None:
        self.vmas = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                start, end = (int(x, 16) for x in parts[0].split("-"))
                path = parts[5].strip() if len(parts) > 5 else ""
                self.vmas.append((start, end, parts[1], int(parts[4]), path))
        self.foreign_allocator = any(name in v[4] for v in self.vmas for name in _FOREIGN_ALLOCATORS)

    def covered(self, lo: int, hi: int, accept) -> bool:
        """Is [lo, hi) mapped without a gap, by mappings that all pass ``accept``?"""
        at = lo
        for start, end, perms, inode, path in self.vmas:
            if end <= at:
                continue
            if start > at or not accept(perms, inode, path):
                return False
            at = end
            if at >= hi:
                return True
        return False


def _private_anonymous(perms: str, inode: int, path: str) -> bool:
    return perms.startswith("rw") and perms.endswith("p") and inode == 0 and (not path or path.startswith("[anon:"))


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def _own_mapping(maps: _Maps, addr: int, nbytes: int) -> bool:
    """Is [addr, addr + nbytes) a glibc heap block with a mapping of its own?

    Such a block is unmapped by free(), so pages moved into a memfd go when it
    goes.  Blocks inside the heap proper are left alone (they are copied).
    """
    if nbytes < 2 * _PAGE or addr % 16 or maps.foreign_allocator:
        return False
    if len(maps.vmas) + 64 > _max_map_count():
        return False
    if not maps.covered(addr - 16, addr + nbytes, _private_anonymous):
        return False
    size_field = ctypes.c_size_t.from_address(addr - 8).value
    prev_size = ctypes.c_size_t.from_address(addr - 16).value
    if not size_field & 2:  # IS_MMAPPED
        return False
    block, total = addr - 16 - prev_size, (size_field & ~7) + prev_size
    if block % _PAGE or total % _PAGE or prev_size > (1 << 20) or block + total < addr + nbytes:
        return False
    return maps.covered(block, block + total, _private_anonymous)


def _move_in_place(addr: int, nbytes: int, owner: Any) -> _Moved | None:
    """Start moving the pages of [addr, addr + nbytes) into a new memfd mapped at the same address.

    The copying runs on a thread of its own (``_fill``), beside the ranks' start-up;
    the record, and so the reference the ranks get, exists at once.
    """
    try:
        owner_ref = weakref.ref(owner)
    except TypeError:
        return None
    base = addr & ~(_PAGE - 1)
    end = (addr + nbytes + _PAGE - 1) & ~(_PAGE - 1)
    lo = (addr + _PAGE - 1) & ~(_PAGE - 1)
    try:
        fd = os.memfd_create("ddp_notebook", os.MFD_CLOEXEC)
    except OSError:
        return None
    rec = _Moved(fd, addr, nbytes, base, lo, lo, end - base)
    rec.owner = owner_ref
    _moved[addr] = rec
    weakref.finalize(owner, _forget, addr, rec)
    # The thread holds the owner: the block cannot be freed (nor its memfd closed) half moved.
    threading.Thread(target=_fill, args=(rec, owner), name="ddp-share-move", daemon=True).start()
    return rec


def _fill(rec: _Moved, owner: Any) -> None:
    """Copy the block into its memfd in address order, mapping each chunk back over the block once written.

    The write of a chunk allocates its pages (an error here is ENOMEM or ENOSPC,
    never SIGBUS later), and mapping the file over the chunk frees its anonymous
    pages: at most one chunk is held twice.  The file grows as it fills and reaches
    ``rec.size`` only when complete, which is what the ranks wait for; a failure
    sets the size past it.  The partial pages at both ends stay the notebook's own;
    the file holds a copy of them.
    """
    lib = _libc()
    addr, base, lo, fd = rec.addr, rec.base, rec.lo, rec.fd
    try:
        if lo > addr:
            write_at(fd, addr, lo - addr, addr - base)
        at = lo
        end = (addr + rec.nbytes) & ~(_PAGE - 1)
        while at < end:
            step = min(_CHUNK, end - at)
            write_at(fd, at, step, at - base)
            if lib.mmap(at, step, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED, fd,
                        at - base) != at:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            at += step
            rec.hi = at
        if addr + rec.nbytes > end:
            write_at(fd, end, addr + rec.nbytes - end, end - base)
        os.ftruncate(fd, rec.size)
        rec.complete = True
    except OSError:
        # The part already moved lives in the memfd (values intact) and stays registered,
        # so forks still get their own copy; later jobs copy the block instead.
        rec.failed = True
        try:
            os.ftruncate(fd, rec.size + _PAGE)
        except OSError:
            pass
    finally:
        del owner
        rec.done.set()


def settle(timeout: float | None = None) -> bool:
    """Wait until every move into shared memory started so far is finished; False on timeout."""
    for rec in list(_moved.values()):
        if not rec.done.wait(timeout):
            return False
    return True


def _spare_memory() -> int:
    """Bytes of RAM a job may take for copies without crowding the machine (or its cgroup)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0
    spare = info.get("MemAvailable", info.get("MemFree", 0))
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":  # v2
                limit_file, usage_file = f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"
            elif "memory" in controllers.split(","):
                limit_file = f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"
                usage_file = f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"
            else:
                continue
            try:
                with open(limit_file) as f:
                    limit = f.read().strip()
                with open(usage_file) as f:
                    usage = int(f.read())
            except OSError:
                continue
            if limit.isdigit() and int(limit) < (1 << 60):
                spare = min(spare, int(limit) - usage)
    except (OSError, ValueError):
        pass
    reserve = max(512 << 20, info.get("MemTotal", 0) // 10)
    return max(0, spare - reserve)


class _Arena:
    """One shared file that copies are appended to, page-aligned: this process's own (``kind`` "memory" or
    "disk"), or the notebook's results file (``into``: its pid and descriptor)."""

    def __init__(self, kind: str, into: tuple[int, int] | None = None):
        self.kind = kind
        if into is not None:
            self.fd = os.open(f"/proc/{into[0]}/fd/{into[1]}", os.O_RDWR | os.O_CLOEXEC)
        elif kind == "memory":
            self.fd = os.memfd_create("ddp_notebook-copies", os.MFD_CLOEXEC)
        else:
            with tempfile.TemporaryFile(prefix="ddp_notebook-") as f:  # unlinked from the start
                self.fd = os.dup(f.fileno())
        self.pid, self.ref_fd = into if into is not None else (os.getpid(), self.fd)  # how others open it
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        self.size = st.st_size

    def append(self, addr: int, nbytes: int) -> int:
        """Copy [addr, addr + nbytes) to the end of the file; its offset there."""
        before = self.size
        offset = self.reserve(nbytes)
        try:
            write_at(self.fd, addr, nbytes, offset)
        except OSError:
            os.ftruncate(self.fd, before)
            self.size = before
            raise
        return offset

    def reserve(self, nbytes: int) -> int:
        """Room for ``nbytes`` at the end of the file, every page of it allocated (no SIGBUS later); its offset."""
        offset = (self.size + ALIGN - 1) // ALIGN * ALIGN
        if self.kind == "disk":
            st = os.statvfs(tempfile.gettempdir())
            if st.f_bavail * st.f_frsize < nbytes + _DISK_MARGIN:
                raise OSError(28, f"not enough free space in {tempfile.gettempdir()}")
        os.ftruncate(self.fd, offset + nbytes)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self.fd, offset, nbytes)
        except OSError:
            os.ftruncate(self.fd, self.size)
            raise
        self.size = offset + nbytes
        return offset


def results_file() -> int | None:
    """Notebook side: a new empty memfd a rank of this host copies the big arrays of its result into (see
    ``Store(results_into=...)``); None where results cannot travel by shared memory.  Close it when the job ends."""
    if min_bytes() is None or not hasattr(os, "memfd_create") or not _proc_fds_usable():
        return None
    try:
        return os.memfd_create("ddp_notebook-results", os.MFD_CLOEXEC)
    except OSError:
        return None


class Store:
    """Consulted by the payload's pickler: big arrays become references to shared buffers.

    ``dry=True`` only tells what would be shared (for naming an unpicklable part): nothing is written.
    ``via_proc=False``: the ranks do not open the buffers through ``/proc`` (an export writes them to a file).
    ``move=False`` copies every array, so the ranks get a snapshot and the notebook's memory is left as it is
    (for jobs that run while the notebook goes on working).
    ``results_into`` (a rank's result): copies go into the notebook's results file, (its pid, the descriptor) of
    :func:`results_file`, and nowhere else (a file of the rank's own would go with the rank).
    """

    def __init__(self, dry: bool = False, move: bool = True, via_proc: bool = True,
                 results_into: tuple[int, int] | None = None):
        self.dry = dry
        self.move = move and results_into is None
        self.results_into = results_into
        self.bundle = Bundle()
        self.min_bytes = min_bytes()
        torch, np = sys.modules.get("torch"), sys.modules.get("numpy")  # never imported for this
        arrow = sys.modules.get("pyarrow")
        self._torch = torch
        self._np = np
        self._tensor_type = getattr(torch, "Tensor", None)
        self._array_types = (np.ndarray, np.memmap) if np is not None else ()
        self._arrow_buffer_type = getattr(arrow, "Buffer", None)
        self._arrow_containers = tuple(getattr(arrow, name) for name in ("Table", "RecordBatch", "ChunkedArray",
                                                                         "Array") if hasattr(arrow, name))
        self._arrow_min_bytes = self.min_bytes  # lowered once a big Arrow table or array is met
        self._enabled = self.min_bytes is not None and (dry or not via_proc or _proc_fds_usable()) \
            and (torch is not None or np is not None or arrow is not None)
        self._placed: dict[tuple, tuple | None] = {}
        self._arenas: dict[str, _Arena] = {}
        self._budget: int | None = None
        self._maps: _Maps | None = None
        self._pid = os.getpid()

    # -- the pickler's hook ------------------------------------------------------------------
    def reduce(self, obj: Any):
        """A reduce tuple for a big tensor or array; None for anything else (pickled as usual)."""
        if not self._enabled:
            return None
        kind = type(obj)
        if kind is self._tensor_type:
            return self._reduce_tensor(obj)
        if kind in self._array_types:
            return self._reduce_array(obj)
        if self._arrow_buffer_type is not None:
            if isinstance(obj, self._arrow_buffer_type):
                return self._reduce_arrow_buffer(obj)
            if isinstance(obj, self._arrow_containers):
                self._note_arrow_container(obj)
        return None

    def _reduce_tensor(self, t):
        torch = self._torch
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta":
            return None
        if t.__dict__:  # Python attributes on the tensor: torch's own pickling keeps them
            return None
        src = t.detach()
        storage = src.untyped_storage()
        # Keys name the notebook's own memory, which the pickler keeps alive for the whole dump (it memoizes
        # every object it saves); a temporary made here is never a key, as its address is reused once freed.
        source = (str(src.device), storage.data_ptr(), storage.nbytes())
        plain = not (src.is_conj() or src.is_neg())
        nbytes = src.numel() * src.element_size()
        layout = (src.storage_offset(), tuple(src.size()), tuple(src.stride()))
        device_type = src.device.type
        if nbytes < self.min_bytes:
            if device_type == "cpu" and storage.nbytes() >= self.min_bytes:
                placed = self._placed.get(source)
                if placed is not None and plain:  # a view of a storage shared already
                    return _rebuild_tensor, (*placed, storage.nbytes(), t.dtype, *layout, bool(t.requires_grad),
                                             "cpu")
                # torch would pickle the whole big storage under this small view: send a copy of the view
                return _same, (t.detach().clone().requires_grad_(t.requires_grad),)
            return None
        if plain and (2 * nbytes >= storage.nbytes() or source in self._placed):
            # The whole storage, or a view of one shared already: aliasing between tensors of one storage survives.
            if device_type == "cpu":
                # (A storage exported with .numpy() is no longer resizable; moving keeps such aliases valid.)
                movable = not storage.is_shared() and not src.is_pinned()
                placed = self._place(source, storage.data_ptr(), storage.nbytes(), storage if movable else None)
            else:
                placed = self._placed.get(source, _MISSING)
                if placed is _MISSING:
                    host = storage.cpu()  # a device's memory is copied through the CPU, whole
                    placed = self._place(source, host.data_ptr(), host.nbytes(), None)
            region_bytes = storage.nbytes()
        else:
            # A small view of a big storage, or a conjugate / negative view: its own elements, resolved.
            key = ("view", source, str(src.dtype), *layout, src.is_conj(), src.is_neg())
            placed = self._placed.get(key, _MISSING)
            if placed is _MISSING:
                copy = src.resolve_conj().resolve_neg().to("cpu").contiguous()
                placed = self._place(key, copy.data_ptr(), nbytes, None)
            region_bytes = nbytes
            layout = (0, tuple(src.size()), _contiguous_strides(tuple(src.size())))
        if placed is None:
            return None
        ref, offset = placed
        return _rebuild_tensor, (ref, offset, region_bytes, t.dtype, *layout, bool(t.requires_grad), device_type)

    def _reduce_array(self, a):
        np = self._np
        if a.dtype.hasobject or a.nbytes < self.min_bytes:
            return None
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        whole = (root.flags.c_contiguous or root.flags.f_contiguous) and 2 * a.nbytes >= root.nbytes
        if whole:
            owner = root if _numpy_default_allocator(np, root) else None
            base_addr = root.ctypes.data
            placed = self._place(("cpu", base_addr, root.nbytes), base_addr, root.nbytes, owner)
            offset_in, strides = a.ctypes.data - base_addr, a.strides
        elif a.flags.c_contiguous or a.flags.f_contiguous:
            placed = self._place(("cpu", a.ctypes.data, a.nbytes), a.ctypes.data, a.nbytes, None)
            offset_in, strides = 0, a.strides
        else:
            key = ("view", "cpu", a.ctypes.data, a.dtype.str, a.shape, a.strides)
            placed = self._placed.get(key, _MISSING)
            if placed is _MISSING:
                copy = np.ascontiguousarray(a)
                placed = self._place(key, copy.ctypes.data, copy.nbytes, None)
            offset_in, strides = 0, _contiguous_strides(a.shape, a.itemsize)
        if placed is None:
            return None
        ref, offset = placed
        return _rebuild_array, (ref, offset + offset_in, a.dtype, a.shape, strides, bool(a.flags.writeable))

    def _note_arrow_container(self, obj) -> None:
        """An Arrow table or array is pickled as its buffers, met right after it: when it holds at least
        ``min_bytes`` in all, share its buffers down to ``ARROW_PART_MIN_BYTES`` (a table of many small record
        batches, as ``Dataset.map`` writes them, would otherwise be pickled whole, buffer by buffer)."""
        if self._arrow_min_bytes > ARROW_PART_MIN_BYTES and obj.get_total_buffer_size() >= self.min_bytes:
            self._arrow_min_bytes = ARROW_PART_MIN_BYTES

    def _reduce_arrow_buffer(self, buf):
        """An Arrow buffer (of a pyarrow Table or Array: a Hugging Face dataset's, a pandas column's) copied once into
        shared memory; the rank wraps the mapped bytes in a ``pyarrow.Buffer`` without a copy of its own.

        Arrow's memory belongs to its own allocator (mimalloc or jemalloc), never a glibc block: it is copied, not
        moved.  Buffers are immutable, so aliases need no care beyond sharing each region once.
        """
        nbytes = buf.size
        if not buf.is_cpu or nbytes < self._arrow_min_bytes:
            return None
        addr = buf.address
        placed = self._place(("cpu", addr, nbytes), addr, nbytes, None)  # the key an array over it would have
        if placed is None:
            return None
        ref, offset = placed
        return _rebuild_arrow_buffer, (ref, offset, nbytes)

    # -- placing bytes -----------------------------------------------------------------------
    def _place(self, key: tuple, addr: int, nbytes: int, owner: Any) -> tuple | None:
        """Share [addr, addr + nbytes) once per ``key`` (the source it was read from): moved if ``owner`` allows."""
        if key in self._placed:
            return self._placed[key]
        if self.dry:
            placed = ((0, -1, 0, 0), 0)
        else:
            placed = self.move_block(addr, nbytes, owner) if owner is not None and self.move else None
            if placed is None:
                placed = self.copy_block(addr, nbytes)
            if placed is None:
                self.bundle.stats["inline"] += nbytes
            else:
                self.bundle.stats["arrays"] += 1
        self._placed[key] = placed
        return placed

    def move_block(self, addr: int, nbytes: int, owner: Any) -> tuple | None:
        """Share a notebook block by moving its pages into shared memory; None when it cannot be moved."""
        if not _can_move():
            return None
        with _moved_lock:
            rec = _moved.get(addr)
            if rec is not None:
                rec.done.wait()  # a move started by an earlier dump
                if rec.failed or nbytes > rec.nbytes:
                    return None
                if not self._still_moved(rec):
                    del _moved[addr]  # its memory was replaced while its owner lives (share_memory_, a resize)
                    os.close(rec.fd)
                    rec = None
                else:
                    # The partial pages at both ends stayed the notebook's own: bring the file's copy up to date.
                    write_at(rec.fd, addr, rec.lo - addr, rec.head)
                    write_at(rec.fd, rec.hi, addr + rec.nbytes - rec.hi, rec.hi - rec.base)
            if rec is None:
                if self._maps is None:
                    self._maps = _Maps()
                if not _own_mapping(self._maps, addr, nbytes):
                    return None
                rec = _move_in_place(addr, nbytes, owner)
                self._maps = None  # the mappings are changing
                if rec is None:
                    return None
            fd = os.dup(rec.fd)  # this job's own descriptor: the owner may die while ranks start
        self.bundle.adopt(fd)
        self.bundle._track_move(rec.done)
        self.bundle.stats["moved"] += nbytes
        return (self._pid, fd, rec.dev, rec.ino, rec.size), rec.head

    def _still_moved(self, rec: _Moved) -> bool:
        """Is the allocation still mapped from its memfd?  (Another alias of it may ask: .numpy() of a tensor.)"""
        if rec.owner is None or rec.owner() is None:
            return False
        maps = _Maps()
        return maps.covered(rec.lo, rec.hi, lambda perms, inode, path: inode == rec.ino and "s" in perms)

    def copy_block(self, addr: int, nbytes: int) -> tuple | None:
        """Share a copy of [addr, addr + nbytes); None when there is no room anywhere."""
        kinds = ["memory"] if self._memory_has_room(nbytes) else []
        if self.results_into is None:
            kinds.append("disk")
        for kind in kinds:
            try:
                arena = self._arena(kind)
                offset = arena.append(addr, nbytes)
            except OSError:
                continue
            self.bundle.stats[kind] += nbytes
            return (arena.pid, arena.ref_fd, arena.dev, arena.ino), offset
        if self.results_into is not None:
            warnings.warn(f"ddp_notebook: no room to share an array of {nbytes / 2**20:.0f} MiB of the result (memory "
                          f"limit reached); it is pickled into the result message instead", stacklevel=2)
            return None
        warnings.warn(f"ddp_notebook: no room to share an array of {nbytes / 2**20:.0f} MiB (memory limit and "
                      f"{tempfile.gettempdir()} both full); it is pickled into the payload instead", stacklevel=2)
        return None


    def new_tensor(self, shape: tuple, dtype: Any) -> Any:
        """A rank's result: an uninitialised CPU tensor whose memory already is the notebook's results file, so that
        a value written there (a sharded model's gathered parameter) is sent without a copy of the rank's own;
        None where it cannot be (no results file, sharing off, below the threshold, no room)."""
        torch = sys.modules.get("torch")
        if self.results_into is None or not self._enabled or torch is None:
            return None
        count = 1
        for size in shape:
            count *= size
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes or not self._memory_has_room(nbytes):
            return None
        try:
            arena = self._arena("memory")
            offset = arena.reserve(nbytes)
            region = mmap.mmap(arena.fd, nbytes, offset=offset)  # MAP_SHARED: the rank writes the file itself
        except OSError:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (frombuffer's warning is about read-only buffers)
            tensor = torch.frombuffer(region, dtype=dtype, count=count).view(shape)
        storage = tensor.untyped_storage()
        # The pickler finds it by its storage (as it finds a block copied in already) and sends the reference.
        self._placed[("cpu", storage.data_ptr(), storage.nbytes())] = \
            ((arena.pid, arena.ref_fd, arena.dev, arena.ino), offset)
        self.bundle.stats["memory"] += nbytes
        self.bundle.stats["arrays"] += 1
        return tensor

    def _memory_has_room(self, nbytes: int) -> bool:
        if not hasattr(os, "memfd_create"):
            return False
        if self._budget is None:
            limit = os.environ.get("DDP_NOTEBOOK_SHM_LIMIT", "").strip()
            self._budget = int(float(limit)) if limit else _spare_memory()
        return self.bundle.stats["memory"] + nbytes <= self._budget

    def _arena(self, kind: str) -> "_Arena":
        arena = self._arenas.get(kind)
        if arena is None:
            arena = self._arenas[kind] = _Arena(kind, self.results_into)
            self.bundle.adopt(arena.fd)
        return arena


_MISSING = object()


def _contiguous_strides(shape: tuple, itemsize: int = 1) -> tuple:
    """Strides of a C-contiguous array of ``shape``, in elements (tensors) or bytes (``itemsize``)."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _numpy_default_allocator(np, root) -> bool:
    """May this array's memory be moved? Not when a custom numpy allocator owns it.

    Memory of another object (a tensor, a buffer) may: whether it is a heap
    block of its own is checked before moving, and the ndarray keeps it alive.
    """
    if not root.flags.owndata:
        # An array over an Arrow buffer (a dataset's column as numpy) is memory of Arrow's allocator: no glibc block.
        return not type(root.base).__module__.startswith("pyarrow")
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    get_handler = getattr(getattr(core, "multiarray", None), "get_handler_name", None)
    if get_handler is None:
        return True  # numpy before 1.22: always malloc
    try:
        return get_handler(root) == "default_allocator"
    except Exception:
        return False


# -- rank side -------------------------------------------------------------------------------------

class _Loading(threading.local):
    """What one load has mapped so far, per thread (the notebook loads a background job's results on its thread)."""

    def __init__(self) -> None:
        self.mapped: dict[tuple, mmap.mmap] = {}
        self.storages: dict[tuple, Any] = {}


_loading = _Loading()


@contextmanager
def loading():
    """One load (a payload in a rank, a result in the notebook): buffers mapped once, tensors of one storage
    rebuilt on one storage."""
    try:
        yield
    finally:
        _loading.mapped.clear()
        _loading.storages.clear()


def _map(ref: tuple) -> mmap.mmap:
    pid, fd, dev, ino = ref[:4]
    mm = _loading.mapped.get((dev, ino))
    if mm is not None:
        return mm
    path = f"/proc/{pid}/fd/{fd}"
    try:
        handle = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise RuntimeError(f"cannot open the shared data of process {pid} ({path}: {exc.strerror}): it has ended "
                           f"(the notebook's, when its job ends; a rank's result, when the rank ends before the "
                           f"notebook reads it), or this system hides other processes' descriptors. Setting "
                           f"DDP_NOTEBOOK_SHARE_MIN_BYTES=off sends big arrays inside the messages instead") from None
    try:
        st = os.fstat(handle)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise RuntimeError(f"{path} is no longer the shared data of process {pid} (it has ended)")
        size = st.st_size
        if len(ref) > 4:  # a block the notebook is still moving into shared memory: wait for all of it
            pause = 0.001
            while size < ref[4]:
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
                size = os.fstat(handle).st_size
            if size > ref[4]:
                raise RuntimeError("the notebook could not move an array into shared memory (out of memory?); "
                                   "DDP_NOTEBOOK_SHARE_INPLACE=0 copies it instead")
        mm = mmap.mmap(handle, size, access=mmap.ACCESS_COPY)  # MAP_PRIVATE: writes stay this rank's
    finally:
        os.close(handle)
    _loading.mapped[(dev, ino)] = mm
    return mm


def _same(value):
    return value


def map_export_arrays(path: str) -> None:
    """Rank side, inside ``loading()``: an export's array file is what its references (``EXPORT_REF``) map."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # a rank's writes stay its own
    _loading.mapped[(EXPORT_REF, os.path.basename(path))] = mm


def _rebuild_tensor(ref, offset, nbytes, dtype, storage_offset, size, stride, requires_grad, device_type):
    import torch

    key = (ref[2], ref[3], offset, nbytes)
    storage = _loading.storages.get(key)
    if storage is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns about non-writable buffers; ours is writable
            storage = torch.frombuffer(_map(ref), dtype=torch.uint8, count=nbytes, offset=offset).untyped_storage()
        _loading.storages[key] = storage
    t = torch.empty((0,), dtype=dtype)
    t.set_(storage, storage_offset, size, stride)
    return on_rank_device(t.requires_grad_(requires_grad), device_type)


_rank_device = None


def set_rank_device(device) -> None:
    """Rank side: where tensors the notebook held on a device land in this process (its own GPU, or the CPU)."""
    global _rank_device
    _rank_device = device


def on_rank_device(t, device_type: str):
    """A tensor the notebook held on a ``device_type`` device: on this rank's own device of that type, else CPU."""
    device = _rank_device
    if device_type != "cpu" and getattr(device, "type", None) == device_type:
        return t.detach().to(device).requires_grad_(t.requires_grad)
    return t


def _rebuild_arrow_buffer(ref, offset, nbytes):
    import pyarrow

    return pyarrow.py_buffer(memoryview(_map(ref))[offset:offset + nbytes])  # the mapped pages themselves


def _rebuild_array(ref, offset, dtype, shape, strides, writeable):
    import numpy as np

    a = np.ndarray(shape, dtype=dtype, buffer=_map(ref), offset=offset, strides=strides)
    if not writeable:
        a.flags.writeable = False
    return a
