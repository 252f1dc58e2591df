"""A rank's entry point: ``python -m ddp_notebook.worker``.

The notebook writes a small JSON bootstrap (channel address, key, rank, ...) to
the rank's stdin.  The rank connects back, sets up the process group once, then
serves tasks until told to exit.  If the notebook goes away (channel closed or
parent gone), the rank ends its own process group at once: an orphan must never
hold a GPU.  Rank side: no IPython, ipywidgets or matplotlib here.
"""
from __future__ import annotations

import collections
import faulthandler
import importlib.abc
import importlib.util
import json
import os
import random
import signal
import sys
import threading
import time

from ..wire import protocol
from ..wire import channel
from . import (background_saves, collectives, context, debugging, display, heap, metrics, profiling, rendezvous,
               replicas, sharded, stopping, streams, timing)
from ..wire import payload, sharing
from ..wire.errors import classify, format_exception

_PARENT_POLL_S = 0.5
_job_dir: str | None = None  # the notebook's private job directory, removed if the notebook dies


def _die_with_group() -> None:
    """The notebook is gone: remove what it left and take the whole rank (and its DataLoader workers) down."""
    try:
        if _job_dir:
            import shutil

            shutil.rmtree(_job_dir, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            _die_with_group()


_leaving = threading.Event()  # the rank closes its connection itself as it exits


def _die_when_closed(conn) -> None:
    channel.wait_closed(conn)
    if not _leaving.is_set():
        _die_with_group()


class Inbox:
    """The notebook's messages to this rank, read on the rank's main thread.

    Between tasks the main thread waits here for the next message, so a warm pool's task starts as soon as it
    arrives (no hand-over from a receiving thread).  During a task, what arrives is read at each batch boundary
    (:func:`stopping.at_batch` and the other boundaries call :meth:`take_waiting`): a stop request counts at once, the rest waits for
    the task's end.  A closed connection ends the rank, whenever it happens (:func:`_die_when_closed`).
    """

    def __init__(self, conn):
        self._conn = conn
        self._later: collections.deque = collections.deque()
        self._reading = threading.Lock()  # a cell's own thread may call should_stop() too

    def next(self) -> tuple:
        """The next message, waiting for it."""
        with self._reading:
            return self._later.popleft() if self._later else self._receive()

    def take_waiting(self) -> None:
        """Read the messages that have arrived, without waiting for more."""
        if not channel.readable(self._conn):
            return
        # An interrupt (the task is interruptible here) waits until what was read is kept and the lock let go.
        with channel.whole_message():
            if not self._reading.acquire(blocking=False):
                return  # another thread reads: it sees them
            try:
                while channel.readable(self._conn):
                    message = self._receive()
                    if message[0] == protocol.STOP:
                        stopping.request(message[1]["task"])
                    else:
                        self._later.append(message)
            finally:
                self._reading.release()

    def answer(self) -> dict:
        """The notebook's answer to this rank's prompt, waiting for it (an interrupt ends the wait).  What else
        arrives first: a stop counts at once, the rest waits for the task's end."""
        with self._reading:
            for message in self._later:  # (read at a batch boundary of another thread before this wait)
                if message[0] == protocol.ANSWER:
                    self._later.remove(message)
                    return message[1]
            while True:
                self._conn.poll(None)  # (outside whole_message: the wait itself may be interrupted)
                kind, body = self._receive()
                if kind == protocol.ANSWER:
                    return body
                if kind == protocol.STOP:
                    stopping.request(body["task"])
                else:
                    self._later.append((kind, body))

    def _receive(self) -> tuple:
        try:
            with channel.whole_message():  # an interrupt waits until the message is read whole
                return self._conn.recv()
        except (EOFError, OSError) as exc:
            if isinstance(exc, channel.FrameRefused):
                print(f"ddp_notebook: this rank stops: {exc}", file=sys.stderr, flush=True)
            _die_with_group()
            raise


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)


def set_device(ctx: context.RankContext, gpus: bool, index: int | None = None) -> None:
    """The rank's device: its own GPU (``cuda:LOCAL_RANK`` of the GPUs it sees, or ``cuda:index``), or the CPU."""
    import torch

    if gpus:
        index = ctx.local_rank if index is None else index
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "CUDA finds no GPU here"
            given = os.environ.get("CUDA_VISIBLE_DEVICES", "?")
            raise RuntimeError(f"the job was given a GPU (CUDA_VISIBLE_DEVICES={given}), but {why} "
                               f"(torch {torch.__version__}); run it with --cpus N, or install a CUDA build of torch")
        torch.cuda.set_device(index)
        ctx.device = torch.device("cuda", index)
    else:
        ctx.device = torch.device("cpu")
    sharing.set_rank_device(ctx.device)


def join_group(ctx: context.RankContext, backend: str, timeout: float | None, store=None) -> None:
    """``init_process_group`` with the job's options: on ``store``, or from the environment (env://, torchrun)."""
    import datetime

    import torch.distributed as dist

    kwargs = {}
    if timeout:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        kwargs["device_id"] = ctx.device
    if store is not None:
        kwargs.update(store=store, rank=ctx.rank, world_size=ctx.world_size)
    dist.init_process_group(backend, **kwargs)


def _init_process_group(boot: protocol.RankStart, ctx: context.RankContext) -> None:
    import datetime

    import torch.distributed as dist

    if boot.user_picks_gpu:
        # spawn() on GPUs: as under mp.spawn, the user's code picks its GPU; the rank's device is not known (not
        # "cpu"), so checkpoint loads follow torch.cuda.current_device() once the user's code has set it.
        ctx.device = None
        sharing.set_rank_device(None)
    else:
        set_device(ctx, boot.gpus)
    if not boot.init_group:
        return
    startup = datetime.timedelta(seconds=boot.startup_timeout)
    if boot.store_file:  # in the job's 0700 folder: no other user can reach it (a TCPStore, any local user)
        store = dist.FileStore(boot.store_file, ctx.world_size)
        store.set_timeout(startup)
    else:
        extra = {}
        if boot.store_fd is not None:
            extra["master_listen_fd"] = boot.store_fd
        store = dist.TCPStore(
            boot.master_addr, boot.master_port, ctx.world_size, ctx.rank == 0,
            timeout=startup, wait_for_workers=False, **extra,
        )
    join_group(ctx, boot.backend, boot.timeout, store)
    ctx.store = store
    if boot.backend != "gloo":  # a graceful stop's flag is reduced on the CPU
        ctx.cpu_group = dist.new_group(backend="gloo")


def _sync(ctx, sender, body: dict, namespace: dict) -> None:
    """After an interrupt: meet every other rank at a barrier kept in the TCPStore (a broken process group cannot
    hang it), check that the process group itself is in step (:func:`_check_group`), then that the DDP replicas
    are (``replicas.reconcile``: made rank 0's where they differ)."""
    store = ctx.store
    timeout = body.get("timeout", 5.0)
    stage = "store"
    try:
        if store is None:
            raise RuntimeError("no store to meet at")
        try:
            rendezvous.meet(f"ddp_notebook/sync/{body['task']}", ctx.rank, ctx.world_size, timeout, store=store)
        except rendezvous.Absent as absent:
            raise TimeoutError(f"not every rank came back: {absent}") from None
        stage = "group"
        sender.send_now(protocol.SYNCED, {"task": body["task"], "stage": "store"})
        _check_group(ctx, body["task"], body.get("check_timeout", timeout))
        sender.send_now(protocol.SYNCED, {"task": body["task"], "stage": "group"})
        stage = "replicas"
        checked = replicas.reconcile(namespace, group=ctx.cpu_group)
        sender.send(protocol.SYNCED, {"task": body["task"], "stage": "replicas", "replicas": checked})
    except Exception as exc:  # noqa: BLE001
        sender.send(protocol.FAILED, {**failure_report(exc, {}, kind="comm"), "task": body["task"], "stage": stage})
    sender.flush()


def _check_group(ctx, task_id: int, timeout: float) -> None:
    """Is the process group in step after an interrupt?  Every rank is at the store barrier, so none is in a cell.

    An interrupted rank may have left a collective no other rank matched: NCCL enqueues every collective and
    returns (gloo does with ``async_op=True``).  The next collective on any rank then pairs with that stale one.
    A plain barrier cannot tell: NCCL's is a one-element all_reduce, which pairs with a stale one and returns.
    So every rank all-reduces a sentinel whose sum is known (``[1, rank, mark]`` summed is ``[W, W(W-1)/2,
    W*mark]``): paired with a stale collective it fails, hangs (the whole check is bounded by ``timeout``) or sums
    wrong.  On a GPU the device's queued work must finish first: a stale NCCL kernel waiting for a peer never does.
    """
    import datetime

    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(0.05, deadline - time.monotonic())

    nccl = dist.get_backend() == "nccl"
    if nccl:  # the GPU-only part
        _synchronize_device(left(), timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    mark = float(task_id % 1000 + 7)
    world = ctx.world_size
    sentinel = torch.tensor([1.0, float(ctx.rank), mark], dtype=torch.float64, device=device)
    expected = [float(world), float(world * (world - 1) // 2), world * mark]
    work = dist.all_reduce(sentinel, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=left()))
    except Exception as exc:  # noqa: BLE001 - timed out, or gloo found the stale collective's data
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(f"the check's all_reduce failed or did not end within {timeout:g} s ({why})") from None
    if nccl:  # whether wait() blocked the CPU depends on torch's NCCL settings; reading the sum would, unbounded
        _synchronize_device(left(), timeout)
    got = sentinel.tolist()
    if got != expected:
        raise RuntimeError(f"the check's all_reduce summed to {got}, not {expected}")


def _synchronize_device(timeout: float, told: float) -> None:
    """``torch.cuda.synchronize()``, bounded: a thread waits for the device, which may never finish."""
    import torch

    ended: list = []
    thread = threading.Thread(target=lambda: ended.append(_catch(torch.cuda.synchronize)), daemon=True,
                              name="ddp-cuda-sync")
    thread.start()
    thread.join(timeout)
    if not ended:
        raise TimeoutError(f"the GPU's queued work did not finish within {told:g} s (a collective waiting "
                           f"for a peer)")
    if ended[0] is not None:
        raise ended[0]


def _catch(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - raised again on the rank's main thread
        return exc
    return None


def failure_report(exc: BaseException, labels: dict, kind: str | None = None) -> dict:
    return {
        "etype": type(exc).__name__,
        "message": str(exc),
        "traceback": format_exception(exc, labels),
        "time": time.time(),
        "kind": str(kind or classify(exc)),  # (a FailureKind's value: the wire carries plain data)
    }


def run_task(ctx: context.RankContext, sender, task_id, load, seed: int | None = None, namespace: dict | None = None,
             interruptible: threading.Event | None = None) -> dict | None:
    """Run one task as every rank runs it (a notebook's rank, or an exported script's under torchrun).

    ``load()`` gives the task; with ``seed`` every generator is seeded first; the
    cell runs in ``namespace``.  The result, or the failure with the cell's own
    traceback, goes to the notebook through ``sender`` (None: there is no
    notebook).  Returns the failure's report, or None when the task succeeded.
    """
    task = None
    failure = None
    running = ctx.task or context.Task(task_id)  # (an export under torchrun without a notebook: no RUN said more)
    debugging.keep_failure(None, None)  # (the last task's frames go)
    try:
        if interruptible is not None:
            interruptible.set()
        task = load()
        replicas.install()
        timing.reset()
        metrics.begin_task()
        if seed is not None:
            _seed_everything(seed)
        if running.profile:
            profiling.start(running.profile, cuda=getattr(ctx.device, "type", None) == "cuda")
        value = task.run(ctx, namespace)
        metrics.hurry()
        background_saves.finish()  # checkpoints still being written are on disk before the task's end is told
        profiling.finish(sender, task_id)  # (before the result: the job has every trace when it ends)
        if interruptible is not None:
            interruptible.clear()
        if sender is not None:
            # Every rank that returns a sharded value joins its gather, sent or not (a cell's are rank 0's).
            store = payload.result_store(running.results_file)
            whole = sharded.whole_copies(value.values if isinstance(value, payload.CellResult) else value,
                                         "" if isinstance(value, payload.CellResult) else "the return value",
                                         ctx.rank, ctx.world_size, running.every_rank_runs,
                                         allocate=store.new_tensor if store is not None else None)
            sent = task.sent_by(ctx.rank, value)
            stopped = stopping.stopped_at()
            result = payload.dumps_result(sent, whole if sent is value else (), store=store)
            try:
                sender.send_now(protocol.RESULT, {"task": task_id, "value": bytes(result),
                                                  **({"stopped": stopped} if stopped else {})})
            finally:
                payload.release(result)  # (its big arrays are in the notebook's file, which outlives this rank)
    except BaseException as exc:  # noqa: BLE001 - the notebook decides what happens next
        if interruptible is not None:
            interruptible.clear()
        kind = "interrupted" if isinstance(exc, KeyboardInterrupt) else \
            "debugger" if debugging.quit_by_debugger(exc) else None
        debugging.leave_out_debugger(exc)
        metrics.hurry()
        profiling.finish(sender, task_id)
        _finish_background_saves_after_a_failure()
        failure = failure_report(exc, payload.traceback_labels(), kind=kind)
        failure["task"] = task_id
        if failure["kind"] == "user":
            debugging.keep_failure(task_id, exc)  # for the debugger post mortem (DEBUG), until the next task
        if sender is not None:
            sender.send(protocol.FAILED, failure)
    if sender is not None:
        sender.flush()
    return failure


def _finish_background_saves_after_a_failure() -> None:
    """A failed task's checkpoints still being written are finished too (the next task may load them); their own
    errors are told on stderr, as the task's failure is what is reported."""
    try:
        messages = background_saves.finish(raise_errors=False)
    except BaseException as exc:  # noqa: BLE001 - an interrupt while waiting: the writes go on, unwaited
        messages = [f"not waited for the checkpoints being written in the background ({type(exc).__name__})"]
    for message in messages:
        print(f"ddp_notebook: {message}", file=sys.stderr, flush=True)


def main() -> None:
    """A rank started as ``python -m ddp_notebook.rank.worker``: its bootstrap on stdin, the notebook its parent."""
    faulthandler.enable()  # a crashing rank shows where it crashed
    boot = protocol.RankStart.from_json(json.loads(sys.stdin.read()))
    sys.stdin.close()
    parent = os.getppid()
    if parent != boot.parent_pid:
        _die_with_group()
    threading.Thread(target=_watch_parent, args=(parent,), name="ddp-parent-watch", daemon=True).start()
    serve(boot)


def _watch_lifeline(fd: int) -> None:
    try:
        while os.read(fd, 1):
            pass
    except OSError:
        pass
    _die_with_group()  # end of stream: the notebook, the only holder of the other end, is gone


def forked_main(boot: protocol.RankStart, lifeline: int) -> None:
    """A rank forked from the rank template, its environment and directory already its own.

    What a fresh interpreter does by itself is done here: fresh random state
    (the template's is shared by every fork), OpenMP's thread count from this
    rank's ``OMP_NUM_THREADS`` (OpenMP read the template's at import).  The
    notebook is not the parent: the rank goes when ``lifeline``, a pipe only the
    notebook writes to, ends.
    """
    faulthandler.enable()
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    threading.Thread(target=_watch_lifeline, args=(lifeline,), name="ddp-parent-watch", daemon=True).start()
    serve(boot)


class NotebookLibraries(importlib.abc.MetaPathFinder):
    """Finds each of the notebook's libraries that a module of the same name in the working folder would shadow
    (``engine.template.shadowed_libraries``) at the file the notebook imported it from, never the folder's."""

    def __init__(self, files: dict[str, str]):
        self.files = files

    def find_spec(self, name, path=None, target=None):
        file = self.files.get(name)
        if file is None:
            return None
        package = os.path.basename(file).startswith("__init__.")
        return importlib.util.spec_from_file_location(
            name, file, submodule_search_locations=[os.path.dirname(file)] if package else None)


def serve(boot: protocol.RankStart) -> None:
    """Connect to the notebook, join the process group, run tasks until told to exit; never returns."""
    debugging.install(None, None)  # input() in a cell says why it cannot work, not "I/O operation on closed file"
    streams.keep_in_order()
    with heap.importing():  # a forked rank imported it in the template
        import torch.distributed  # noqa: F401  the rank's own imports, from where the notebook's came: never from
        #                           the working folder, which the notebook's sys.path (applied next) may hold
    sys.path[:] = boot.sys_path
    if boot.libraries:
        sys.meta_path.insert(0, NotebookLibraries(boot.libraries))
    global _job_dir
    _job_dir = boot.job_dir
    if _job_dir:  # job.stacks(): every thread's Python stack on SIGUSR1, even while blocked in C code
        stacks = os.fdopen(os.open(protocol.stacks_path(_job_dir, boot.rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                   0o600), "a")  # private, whatever the umask of the process it was forked from
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        collectives.install(_job_dir, boot.rank)  # job.why(): the collectives it called, read on request

    conn = channel.connect(boot.address, bytes.fromhex(boot.key), boot.startup_timeout)
    sender = channel.Sender(conn)
    ctx = context.RankContext(
        rank=boot.rank, local_rank=boot.local_rank, world_size=boot.world_size,
        local_world_size=boot.local_world_size, sender=sender,
    )
    context.set_current(ctx)
    display.install()
    sender.send(protocol.HELLO, {"rank": ctx.rank, "pid": os.getpid()})
    inbox = Inbox(conn)
    stopping.set_poll(inbox.take_waiting)
    if channel.CAN_WAIT_CLOSED:  # (elsewhere the parent's or the lifeline's watch ends an orphan)
        threading.Thread(target=_die_when_closed, args=(conn,), name="ddp-channel-watch", daemon=True).start()

    try:
        _init_process_group(boot, ctx)
    except BaseException as exc:  # noqa: BLE001 - every start-up failure is reported
        sender.send(protocol.FAILED, failure_report(exc, {}, kind="startup"))
        sender.flush()
        os._exit(1)
    sender.send(protocol.READY, {})
    debugging.install(sender.send_now, inbox.answer)  # (after the group: torch.distributed is imported)

    namespace: dict = {}  # kept across tasks: a warm rank remembers the cell's names
    interruptible = threading.Event()

    def interrupt(signum, frame):  # the notebook interrupts a cell, never the loop between cells
        if interruptible.is_set():
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    while True:
        kind, body = inbox.next()
        if kind == protocol.EXIT:
            break
        if kind == protocol.STOP:  # (one read at a batch boundary counts there)
            stopping.request(body["task"])
            continue
        if kind == protocol.SYNC:
            _sync(ctx, sender, body, namespace)
            continue
        if kind == protocol.DEBUG:
            debugging.debug_failure(body["task"])
            continue
        if kind != protocol.RUN:
            continue
        results_files = body.get("results_files")  # (the notebook's pid, and a file of each rank's)
        ctx.task = context.Task(
            body["task"], attempt=int(body.get("attempt", 0)), every_rank_runs=body.get("every_rank", True),
            profile=body.get("profile"),  # --profile (rank/profiling.py)
            results_file=(results_files[0], results_files[1][ctx.rank])
            if results_files and ctx.rank in results_files[1] else None)
        load = (lambda: payload.loads(body["data"])) if "data" in body else (lambda: payload.load(body["path"]))
        run_task(ctx, sender, body["task"], load, body.get("seed"), namespace, interruptible)

    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sender.send(protocol.BYE, {})
    sender.flush()
    _leaving.set()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
