"""The rank side of an exported script: ``train.py`` hands over here, under torchrun or alone.

Every rank checks the versions in the export's manifest before it unpickles
anything, joins the process group from torchrun's environment (env://;
``cuda:LOCAL_RANK`` with nccl when CUDA is available, else gloo on the CPU),
and runs the task exactly as a notebook's rank does
(:func:`ddp_notebook.worker.run_task`).

Where its events go (``report()``, ``progress()``, its result or failure):

* to the notebook that runs node 0 of the job, when the export names one: every
  rank, on every node, connects back to that notebook's channel with the job's
  key and talks to it as the notebook's own ranks do;
* else to the run directory: one JSON-lines file per node,
  ``metrics-node<GROUP_RANK>.jsonl``, written by the node's local rank 0 alone
  (:class:`NodeLog`; the node's other ranks hand it their events over a local,
  authenticated channel), append-only, one self-contained line per event,
  ending with an ``end`` line.  :func:`ddp_notebook.follow` reads those files.

Rank side: no IPython here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import queue
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from multiprocessing.connection import wait as wait_ready

from ..wire import channel
from . import collectives, context, debugging
from ..wire import protocol, safe_files, sharing, versions
from ..wire.protocol import RUN_DIR_ENV, metrics_path
from . import worker

FAILED_WAIT_S = 5.0  # a node whose own rank failed waits this long for its other ranks' last events
PROGRESS_EVERY_S = 1.0  # progress lines per rank in the metrics file, at most
SYNC_EVERY_S = 1.0  # the metrics file is fsynced this often (readers on other hosts see it)
STILL_AFTER_S = 10.0  # reporting through files: collectives still this long, a rank writes where it is
DEVICE_INDEX_ENV = "DDP_NOTEBOOK_DEVICE_INDEX"  # the rank's GPU among those it sees, when not LOCAL_RANK
NO_CUDA_FOR_NCCL = ("this job was exported for GPUs (backend nccl) but this host has no CUDA device "
                    "(torch.cuda.is_available() is False): run it on a GPU host, or export it for CPUs "
                    "(--cpus, without --backend nccl)")


def main(manifest_path: str, argv: list[str]) -> int:
    """The exported script's entry; its exit status."""
    parser = argparse.ArgumentParser(prog=os.path.basename(sys.argv[0] or "train.py"),
                                     description="A notebook task exported by ddp_notebook; run it with torchrun.")
    parser.add_argument("--run-dir", default=None, metavar="DIR",
                        help=f"where report() writes metrics-node<I>.jsonl (default: the export's --run-dir, "
                             f"${RUN_DIR_ENV}, or beside the script)")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(manifest_path))
    with open(manifest_path) as f:
        manifest = json.load(f)
    problems = versions.version_problems(manifest["versions"])
    if problems and not os.environ.get(versions.SKIP_CHECK_ENV):
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
            print(versions.version_message(manifest["versions"], problems, os.path.abspath(sys.argv[0])),
                  file=sys.stderr)
        return 2
    _single_process_env()
    for path in manifest.get("sys_path", []):  # after this host's own: its packages were checked above
        if path not in sys.path and os.path.isdir(path):
            sys.path.append(path)
    with open(os.path.join(here, manifest["payload"]), "rb") as f:
        run = pickle.load(f)
    run_dir = args.run_dir or os.environ.get(RUN_DIR_ENV) or manifest.get("run_dir") or here
    ctx = context.RankContext(rank=int(os.environ["RANK"]), local_rank=int(os.environ["LOCAL_RANK"]),
                              world_size=int(os.environ["WORLD_SIZE"]),
                              local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    context.set_current(ctx)
    return _run(ctx, run, here, os.path.abspath(run_dir))


def _single_process_env() -> None:
    """``python train.py`` without torchrun: a process group of one."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                      GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _node() -> int:
    return int(os.environ.get("GROUP_RANK", "0"))


def _run(ctx: context.RankContext, run: dict, here: str, run_dir: str) -> int:
    notebook = run.get("notebook")
    key = bytes.fromhex(notebook["key"]) if notebook is not None else None  # signs the run files the notebook reads
    files_if_unreachable = notebook is not None and notebook.get("files_if_unreachable", False)
    sender = finished = None
    if notebook is not None:
        connected = _connect_notebook(ctx, notebook, quiet=files_if_unreachable)
        if connected is not None:
            sender, finished, answers = connected
        elif not files_if_unreachable or _notebook_gone(ctx, notebook, here):
            return 1
    log = None
    # why(): the collectives it called, asked over the channel or written to the run files (torch reads this as
    # the process group is made)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", protocol.FLIGHT_RECORDER_ENTRIES)
    try:
        import torch

        gpus = torch.cuda.is_available()
        if run["backend"] == "nccl" and not gpus:  # before torch's own, unclear failure in init_process_group
            raise RuntimeError(NO_CUDA_FOR_NCCL)
        index = int(os.environ.get(DEVICE_INDEX_ENV, ctx.local_rank))  # set where a scheduler binds a GPU per rank
        if gpus and index >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {ctx.local_rank} has no GPU of its own: this node has "
                               f"{torch.cuda.device_count()}; give torchrun --nproc-per-node "
                               f"{torch.cuda.device_count()} or fewer")
        worker.set_device(ctx, gpus, index)
        worker.join_group(ctx, run["backend"] or ("nccl" if gpus else "gloo"), run["timeout"])
        if files_if_unreachable:
            unreached = _unreached(ctx, sender is not None)
            if unreached:  # every rank reports through the files, so that one way holds the whole run
                _leave_notebook(sender, finished, unreached, ctx.unreached_why, run_dir)
                sender = finished = notebook = None
        if notebook is None:
            log = NodeLog(ctx, run_dir, keep_results=run.get("results_to_files", False), key=key)
            ctx.sender = log.sender
    except BaseException as exc:  # noqa: BLE001 - every start-up failure is told
        failure = worker.failure_report(exc, {}, kind="startup")
        _tell(ctx, failure, notebook)
        if sender is not None:
            sender.send(protocol.FAILED, {**failure, "task": notebook["task"]})
            sender.flush()
        return 1
    if sender is not None:
        ctx.task = context.Task(notebook["task"])
        debugging.install(sender.send_now, answers.get)  # input() and pdb ask in the notebook
    elif run.get("notebook") is not None:
        debugging.install(None, None)  # reporting through files: a prompt fails saying so
    if sender is not None:
        sender.send(protocol.READY, {})
    still = threading.Event()
    if log is not None:  # follow()'s run.why(): no one can ask these ranks, so they write where they are stuck
        collectives.tell_when_still(log.sender.send, float(os.environ.get(protocol.STILL_AFTER_ENV, STILL_AFTER_S)),
                                    still)
    failure = worker.run_task(ctx, sender or log.sender, notebook["task"] if notebook else 0,
                              lambda: _load_task(ctx, run, here), run["seed"], {})
    still.set()
    if failure is not None:
        _tell(ctx, failure, notebook)
    if finished is not None:
        finished.set()  # from here on, the notebook may close the channel
    if log is not None:
        log.close(failed=failure is not None)
    if sender is not None:
        sender.send(protocol.BYE, {})
        sender.flush()
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0 if failure is None else 1


def _load_task(ctx: context.RankContext, run: dict, here: str):
    with sharing.loading():
        if run["arrays"]:
            sharing.map_export_arrays(os.path.join(here, run["arrays"]))
        task = pickle.loads(run["task"])
    if run.get("remove_after_load"):
        _loaded(here, ctx.rank, ctx.world_size)
    return task


def _loaded(here: str, rank: int, world_size: int) -> None:
    """This rank is done with the export: the last rank to say so removes it (its arrays stay mapped where used).

    Markers rather than a collective: a rank that fails to load must not leave the others waiting.
    """
    try:
        open(os.path.join(here, f"loaded-rank{rank}"), "w").close()
        if len([n for n in os.listdir(here) if n.startswith("loaded-rank")]) >= world_size:
            shutil.rmtree(here, ignore_errors=True)
    except OSError:
        pass  # removed already by another rank, or by the notebook


def _tell(ctx: context.RankContext, failure: dict, notebook: dict | None) -> None:
    """A failure on this host's console (node 0's, under a notebook, is the notebook's to show)."""
    if notebook is not None and _node() == 0:
        return
    print(f"[ddp_notebook] rank {ctx.rank} failed: {failure['etype']}: {failure['message']}\n"
          f"{failure['traceback'].rstrip()}", file=sys.stderr, flush=True)


# -- a notebook runs node 0 ----------------------------------------------------------------------

def _connect_notebook(ctx: context.RankContext, notebook: dict, quiet: bool = False):
    host, port = notebook["address"]
    try:
        conn = channel.connect((host, port), bytes.fromhex(notebook["key"]), notebook.get("connect_timeout"))
    except Exception as exc:  # refused, unreachable, or a key that is not this job's
        if quiet:
            ctx.unreachable = f"{type(exc).__name__}: {exc}"
            return None
        print(f"ddp_notebook: rank {ctx.rank} cannot reach the notebook that runs node 0 of this job at "
              f"{host}:{port} ({type(exc).__name__}: {exc}). This export belongs to that notebook's run of the "
              f"cell: start it while the cell runs, or export the cell again without --nnodes to run it on its "
              f"own.", file=sys.stderr, flush=True)
        return None
    sender = channel.Sender(conn)
    ctx.sender = sender
    sender.send(protocol.HELLO, {"rank": ctx.rank, "pid": os.getpid(), "node": _node(), "host": socket.gethostname()})
    finished = threading.Event()
    answers: queue.Queue = queue.Queue()
    threading.Thread(target=_watch_notebook, args=(ctx, conn, finished, notebook, answers),
                     name="ddp-notebook-watch", daemon=True).start()
    return sender, finished, answers


def _notebook_gone(ctx: context.RankContext, notebook: dict, here: str) -> bool:
    """True when the kernel that submitted this job has stopped touching its heartbeat file (killed while the job
    waited in the queue): a kernel that is alive but cannot be reached keeps it fresh."""
    heartbeat = notebook.get("heartbeat")
    if heartbeat is None:
        return False
    try:
        with open(os.path.join(here, heartbeat["file"])) as f:
            age = time.time() - float(f.read())
    except (OSError, ValueError):
        age = float("inf")
    if age <= heartbeat["stale_after"]:
        return False
    when = "is gone" if age == float("inf") else f"stopped answering {age:.0f} s ago"
    print(f"ddp_notebook: rank {ctx.rank}: the notebook that submitted this job {when} (its kernel ended while the "
          f"job was queued?): the cell is not run", file=sys.stderr, flush=True)
    _loaded(here, ctx.rank, ctx.world_size)  # nobody else is left to remove the export; other ranks may still read it
    return True


def _unreached(ctx: context.RankContext, reached: bool) -> list[int]:
    """The ranks that could not reach the notebook (every rank learns all of them)."""
    everyone = _all_gather_json(ctx, {"reached": reached, "why": ctx.unreachable})
    ctx.unreached_why = next((e["why"] for e in everyone if not e["reached"]), None)
    return [rank for rank, e in enumerate(everyone) if not e["reached"]]


def _all_gather_json(ctx: context.RankContext, value) -> list:
    """Every rank's ``value`` (JSON), in rank order.  ``all_gather_object`` would unpickle what the peers send, and
    anyone who can reach the process group's connections could send a pickle."""
    import torch
    import torch.distributed as dist

    device = ctx.device if dist.get_backend() == "nccl" else torch.device("cpu")
    data = json.dumps(value).encode()
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(size) for _ in range(ctx.world_size)]
    dist.all_gather(sizes, size)
    sizes = [int(s.item()) for s in sizes]
    mine = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine)
    return [json.loads(bytes(t[:n].tolist())) for t, n in zip(everyone, sizes)]


def _leave_notebook(sender, finished, unreached: list[int], why: str | None, run_dir: str) -> None:
    """Tell the notebook (from a rank that reached it) that the run reports through files, then hang up."""
    if sender is None:
        return
    names = ", ".join(map(str, unreached[:8])) + (", ..." if len(unreached) > 8 else "")
    reason = f"rank(s) {names} could not reach it" + (f" ({why})" if why else "")
    sender.send(protocol.FILES, {"reason": reason, "run_dir": run_dir})
    sender.flush()
    finished.set()
    sender.close()


def _watch_notebook(ctx: context.RankContext, conn, finished: threading.Event, notebook: dict,
                    answers: queue.Queue) -> None:
    """The notebook stops a job by closing its channel: a rank still at work then stops at once.  The answers to
    the rank's prompts (rank/debugging.py) go to ``answers``; ``job.why()`` and ``job.stacks()`` are answered
    here, on this thread, since the rank's main thread may be blocked in a collective."""
    while True:
        try:
            kind, body = conn.recv()  # (nothing else the notebook says asks for anything here)
            if kind == protocol.ANSWER:
                answers.put(body)
            elif kind == protocol.WHERE and ctx.sender is not None:
                ctx.sender.send_now(protocol.HERE, collectives.here(body))
        except (EOFError, OSError):
            if finished.is_set():
                return
            print(f"ddp_notebook: rank {ctx.rank}: the notebook ended this job (or is gone); stopping",
                  file=sys.stderr, flush=True)
            if _node() == 0 and ctx.local_rank == 0 and notebook.get("job_dir"):
                shutil.rmtree(notebook["job_dir"], ignore_errors=True)  # the notebook's, on its own host
            os._exit(1)


# -- no notebook: the node's metrics file --------------------------------------------------------

class NodeLog:
    """This rank's way to the node's metrics file, which the node's local rank 0 alone writes.

    Local rank 0 of each node listens on a local channel; every rank of the node
    (itself included) sends it what ``report()``/``progress()`` send a notebook,
    and its failure.  The address, key and the run's id reach the ranks through
    the process group (one gather of JSON at start: :func:`_all_gather_json`).
    """

    def __init__(self, ctx: context.RankContext, run_dir: str, keep_results: bool = False, key: bytes | None = None):
        self.ctx = ctx
        self.node = _node()
        self._writer: _Writer | None = None
        mine = None
        server = None
        if ctx.local_rank == 0:
            server = channel.ChannelServer("127.0.0.1")
            mine = {"node": self.node, "address": list(server.address), "key": server.key.hex(),
                    "run": uuid.uuid4().hex[:12]}
        try:
            gathered = _all_gather_json(ctx, mine)
            run_id = gathered[0]["run"]  # global rank 0 is local rank 0 of node 0
            host = next(g for g in gathered if g is not None and g["node"] == self.node)
            if server is not None:
                _run_folder(run_dir, strict=key is not None)
                head = {"run": run_id, "node": self.node}
                start = {"event": protocol.FILE_START, "world_size": ctx.world_size,
                         "nnodes": int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                         "local_world_size": ctx.local_world_size, "host": socket.gethostname()}
                self._writer = _Writer(server, metrics_path(run_dir, self.node), head, start, ctx.local_world_size,
                                       keep_results, key)
        except BaseException:
            if server is not None and self._writer is None:
                server.close()
            raise
        self._conn = channel.connect(tuple(host["address"]), bytes.fromhex(host["key"]))
        self.sender = channel.Sender(self._conn)
        self.sender.send(protocol.HELLO, {"rank": ctx.rank})

    def close(self, failed: bool) -> None:
        """Say goodbye and wait until the writer has taken this rank's last events; local rank 0 then ends
        the file (after the node's other ranks, or ``FAILED_WAIT_S`` when it failed itself)."""
        self.sender.send(protocol.BYE, {})
        self.sender.flush()
        try:
            self._conn.poll(10.0)  # the writer hangs up once it has written what came before the bye
        except (EOFError, OSError):
            pass
        if self._writer is not None:
            self._writer.finish(FAILED_WAIT_S if failed else None)
        self._conn.close()


def _run_folder(path: str, strict: bool) -> None:
    """Make the run folder, readable by this user alone.  ``strict`` (a notebook reads it with the job's key): a
    folder already there must be this user's, and no other user may write in it."""
    try:
        os.makedirs(path, 0o700)
        return
    except FileExistsError:
        if not strict:
            return  # an export's own folder (beside the script, or --run-dir): its files are made afresh
    st = os.lstat(path)
    problem = None
    if not stat.S_ISDIR(st.st_mode):
        problem = "is not a folder"
    elif st.st_uid != os.geteuid():
        problem = f"belongs to {safe_files.user_name(st.st_uid)}"
    elif st.st_mode & 0o022:
        problem = f"may be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    if problem is not None:
        raise RuntimeError(f"the run folder {path} {problem}: the run's metrics and results go only into a folder "
                           f"of yours; remove it, or give another --run-dir")


class _Writer:
    """Local rank 0's thread that appends the node's events to its metrics file.

    The file is new for each run (created beside, then renamed over the old one),
    written append-only in whole lines by this one process, and fsynced about
    once a second, so a reader on another host of a shared filesystem only ever
    sees whole lines of one run.
    """

    def __init__(self, server: channel.ChannelServer, path: str, head: dict, start: dict, local_world_size: int,
                 keep_results: bool = False, key: bytes | None = None):
        self.server = server
        self.keep_results = keep_results  # each rank's return value to result-rank<R>.pkl beside the file
        self.key = key  # each record signed with it (protocol.signed_record): the notebook reads only those
        self.head = head
        self.local_world_size = local_world_size
        self.path = path
        self.fd, tmp = safe_files.new_temp(path)
        os.replace(tmp, path)
        self.lines: list[bytes] = []
        self.conns: dict = {}  # connection -> rank (-1 until its hello)
        self.done: set[int] = set()
        self.failed = False
        self._progress: dict[int, float] = {}
        self._synced = time.monotonic()
        self._closing = threading.Event()
        self._deadline: float | None = None
        self._line(start)
        self._flush(sync=True)
        self._thread = threading.Thread(target=self._loop, name="ddp-node-log", daemon=True)
        self._thread.start()

    def _line(self, record: dict) -> None:
        record = {**self.head, "time": time.time(), **record}
        if self.key is not None:
            record = protocol.signed_record(record, self.key)
        self.lines.append((json.dumps(record) + "\n").encode())

    def _flush(self, sync: bool = False) -> None:
        if self.lines:
            os.write(self.fd, b"".join(self.lines))
            self.lines = []
        if sync or time.monotonic() - self._synced >= SYNC_EVERY_S:
            os.fsync(self.fd)
            self._synced = time.monotonic()

    def _loop(self) -> None:
        while True:
            for conn in self.server.new_connections():
                self.conns[conn] = -1
            for conn in wait_ready(list(self.conns), 0.1):
                self._read(conn)
            self._flush()
            for conn, rank in list(self.conns.items()):
                if rank in self.done:  # written: let the rank go
                    del self.conns[conn]
                    conn.close()
            if self._closing.is_set() and (len(self.done) >= self.local_world_size or
                                           self._deadline is not None and time.monotonic() > self._deadline):
                break
        self._line({"event": protocol.FILE_END, "ok": not self.failed and len(self.done) >= self.local_world_size})
        self._flush(sync=True)
        os.close(self.fd)
        for conn in self.conns:
            conn.close()
        self.server.close()

    def _read(self, conn) -> None:
        try:
            while conn.poll():
                kind, body = conn.recv()
                rank = self.conns[conn]
                if kind == protocol.HELLO:
                    rank = self.conns[conn] = int(body["rank"])
                    self._line({"event": protocol.READY, "rank": rank})
                elif rank < 0:
                    continue
                elif kind == protocol.METRIC:
                    for report in protocol.expand_reports(body["reports"]):
                        self._line({"event": protocol.METRIC, "rank": rank, **report})
                elif kind == protocol.PROGRESS:
                    now = time.monotonic()
                    if body["done"] >= body["total"] or now - self._progress.get(rank, -1e9) >= PROGRESS_EVERY_S:
                        self._progress[rank] = now
                        self._line({"event": protocol.PROGRESS, "rank": rank, "done": body["done"], "total": body["total"]})
                elif kind == protocol.RESULT and self.keep_results:
                    self._line({"event": protocol.FILE_RESULT, "rank": rank,
                                "file": self._keep(protocol.result_name(rank), body["value"]),
                                "sha256": hashlib.sha256(body["value"]).hexdigest()})
                elif kind == protocol.HERE:
                    self._line({"event": protocol.HERE, "rank": rank,
                                **{k: body[k] for k in ("collectives", "stack", "error") if k in body}})
                elif kind == protocol.FAILED:
                    self.failed = True
                    self._line({"event": protocol.FAILED, "rank": rank, **{k: body[k] for k in
                                                                   ("etype", "message", "traceback", "kind")}})
                elif kind == protocol.BYE:
                    self.done.add(rank)
                    self._line({"event": protocol.FILE_EXIT, "rank": rank})
        except (EOFError, OSError):
            rank = self.conns.pop(conn, -1)
            conn.close()
            if rank >= 0 and rank not in self.done:
                self.done.add(rank)
                self.failed = True
                self._line({"event": protocol.FILE_EXIT, "rank": rank, "lost": True})

    def _keep(self, name: str, data: bytes) -> str:
        """Write a file beside the metrics file, whole before it has its name."""
        path = os.path.join(os.path.dirname(self.path), name)
        fd, tmp = safe_files.new_temp(path)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return name

    def finish(self, wait: float | None) -> None:
        self._deadline = None if wait is None else time.monotonic() + wait
        self._closing.set()
        self._thread.join()
