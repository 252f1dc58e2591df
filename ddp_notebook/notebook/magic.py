"""The ``%%ddp`` cell magic: turn a cell into a task and hand it to the engine (through :mod:`ddp_notebook.api`)."""
from __future__ import annotations

import argparse
import builtins
import functools
import linecache
import math
import re
import sys
import time
import warnings

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.utils.process import arg_split

from .. import api
from ..engine import callbacks
from ..engine import export as exporting
from ..engine import job as engine_job
from ..engine import pool as pool_module
from ..engine import profiling
from ..engine import spec as job_spec
from ..engine import template as rank_template
from ..wire import payload
from ..wire.errors import JobStopped, LaunchError, RankError, Stopped
from . import cell_reading, dashboard, profile_view, prompting


def parse_flags(magic, line: str):
    """The magic's flags; a list may have spaces after its commas: ``--return m, opt`` is ``--return m,opt``."""
    args = argparse.Namespace()
    args.__dict__.update(_parsed_flags(magic, line))  # (a cell run again has the same line: parsed once)
    for name, value in args.__dict__.items():
        if isinstance(value, list):
            args.__dict__[name] = list(value)  # the cached lists stay as parsed
    return args


def _flags_and_code(magic, line: str) -> tuple[str, str]:
    """A one-line ``%ddp --cpus 2 print(rank)`` as its flags and its code: the longest start of it that parses as
    flags, and the rest."""
    starts = [match.start() for match in re.finditer(r"\S+", line)] + [len(line)]
    for start in reversed(starts):
        try:
            _parsed_flags(magic, line[:start].strip())
        except (UsageError, ValueError):  # (ValueError: arg_split's unbalanced quotes)
            continue
        return line[:start].strip(), line[start:].strip()
    return "", line.strip()


@functools.lru_cache(maxsize=32)
def _parsed_flags(magic, line: str):
    tokens: list[str] = []
    for token in arg_split(line, strict=True):
        previous = tokens[-1] if tokens else "-"
        bare_flag = previous.startswith("-") and "=" not in previous
        if not bare_flag and not token.startswith("-") and (previous.endswith(",") or token.startswith(",")):
            tokens[-1] += token
        else:
            tokens.append(token)
    return tuple(vars(magic.parser.parse_args(tokens)).items())


_told_shadowed: set[str] = set()  # rank names whose shadowing the user was warned of


def _refuse_undefined(cell: str, user_ns: dict, warm, export_only: bool) -> None:
    """Refuse a cell that reads a name nothing defines: every rank would fail with NameError."""
    held = set() if warm is None else warm.rank_names
    if held is None:
        return
    missing = {name: line for name, line in cell_reading.undefined_names(cell, user_ns).items() if name not in held}
    if missing:
        where = ", ".join(f"{name} (line {line + 1})" for name, line in missing.items())
        pool = ", the warm pool's ranks" if warm is not None else ""
        raise LaunchError(f"the cell reads {where}, which nothing defines: not the cell, the notebook{pool} or "
                          f"Python's builtins, so every rank would fail with NameError (an import missing?). "
                          f"{'Nothing was exported' if export_only else 'No rank was started'}.")


def _refuse_unassigned_returns(reading: cell_reading.CellReading, returns: list[str], names, warm) -> None:
    """Refuse a ``--return`` name that no rank can hold when the cell ends: the cell binds it nowhere (no
    assignment, import, def, class, for or with target, :=, global, ... in any scope), does not read it from the
    notebook, and it is not a rank's own name nor one a warm pool's ranks hold from earlier cells."""
    bound = reading.bound
    held = set() if warm is None else warm.rank_names
    if not returns or bound is None or held is None:  # (None: no reading of the code can tell)
        return
    never = [name for name in returns
             if name not in bound and name not in names and name not in payload.RANK_NAMES and name not in held]
    if never:
        them = "it" if len(never) == 1 else "them"
        pool = f", nor do the warm pool's ranks hold {them}" if warm is not None else ""
        raise LaunchError(f"--return {', '.join(never)}: the cell never assigns {them} (no assignment, import, "
                          f"def, class, for or with target, := or global of {them} anywhere in it){pool}, so no "
                          f"rank could return {them}. No rank was started.")


def _parse_returns(text: str | None) -> list[str]:
    if not text:
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if not n.isidentifier()]
    if bad:
        raise UsageError(f"--return takes names separated by commas; not a name: {', '.join(bad)}")
    return names


@magics_class
class DDPMagics(Magics):
    @magic_arguments()
    @argument("--gpus", default=None, metavar="N|I,J,..",
              help="a count (2: the least busy GPUs) or GPU indices (0,2,5; one index is written 3,)")
    @argument("--cpus", type=int, default=None, metavar="N", help="N CPU ranks (gloo backend)")
    @argument("--backend", choices=("nccl", "gloo"), default=None,
              help="process-group backend (default: nccl on GPUs, gloo on CPU ranks)")
    @argument("--force", action="store_true",
              help="with --gpus I,J: use GPUs another job has reserved (shared with it)")
    @argument("--wait", type=float, nargs="?", const=math.inf, default=None, metavar="MINUTES",
              help="with --gpus N: wait (up to MINUTES; no limit without) until N GPUs are free of other jobs' "
                   "reservations and load, first come first served")
    @argument("--port", type=int, default=None, metavar="P",
              help="master port (default: a free port for each job)")
    @argument("--seed", type=int, default=None, metavar="S",
              help="seed python, numpy and torch identically on every rank before the cell runs")
    @argument("--timeout", type=float, default=None, metavar="SECONDS",
              help="bound for each collective (passed to init_process_group)")
    @argument("--max-restarts", type=int, default=0, metavar="N",
              help="when a rank fails, stop every rank and run the cell again on fresh ranks, up to N times "
                   "(ddp_notebook.attempt(), ddp_notebook.resume())")
    @argument("--grace", type=float, default=10.0, metavar="SECONDS",
              help="after the first interrupt (or Stop), how long the ranks may take to reach a batch boundary "
                   "and stop gracefully before they are stopped hard")
    @argument("--hang-after", type=float, default=None, metavar="SECONDS",
              help="after this long without progress (report, batch, collective, result), say why the job is "
                   "stuck: which ranks wait in which collective, which rank is elsewhere (default 180; 0: never)")
    @argument("--log-dir", default=None, metavar="DIR",
              help="also write every rank's complete output to DIR/rank<N>.log (job.logs(rank) keeps the newest "
                   "16 MB in memory)")
    @argument("--profile", nargs="?", const="", default=None, metavar="steps=N,skip=M",
              help="run torch.profiler on every rank over N steps (default 10) after M (default 5): one merged "
                   "trace (--log-dir, else the working folder) and where each rank's time went, under the cell")
    @argument("--return", dest="returns", default=None, metavar="a,b",
              help="names assigned in the cell to copy back from rank 0 (tensors to CPU, DDP unwrapped)")
    @argument("--output", choices=("all", "0"), default="all", help="show every rank's output, or rank 0's only")
    @argument("--callback", dest="callbacks", action="append", default=[], metavar="NAME",
              help="a callable in the notebook (or wandb) that gets each reported record, reduced over ranks")
    @argument("--tensorboard", default=None, metavar="DIR", help="write the reported metrics to TensorBoard in DIR")
    @argument("--ranks", default=None, metavar="I,J",
              help="on a warm pool: run the cell on these ranks only (for inspection; collectives would hang)")
    @argument("--background", action="store_true",
              help="return a Job at once and keep training while other cells run")
    @argument("--debug", action="store_true",
              help="keep the first failing rank at its failure (the others are stopped): %%ddp_debug then opens "
                   "the debugger there")
    @argument("--export", default=None, metavar="SCRIPT.py",
              help="write the cell as a script for torchrun (its payload beside it) and do not run it; "
                   "with --nnodes: the script the other hosts run")
    @argument("--run-dir", default=None, metavar="DIR",
              help="with --export: where the script's report() writes metrics-node<I>.jsonl (default: beside "
                   "the script), which ddp_notebook.follow(DIR) shows")
    @argument("--nnodes", type=int, default=1, metavar="N",
              help="run this host's ranks as node 0 of a job on N hosts (static rendezvous at "
                   "--master-addr:--port); the other hosts run the export under torchrun")
    @argument("--node-rank", type=int, default=0, metavar="I",
              help="the notebook's node: 0 (the other nodes run under torchrun)")
    @argument("--master-addr", default=None, metavar="HOST",
              help="with --nnodes: this host's address, as the other hosts reach it")
    @argument("--executor", default=None, metavar="NAME",
              help="a submitit executor in the notebook: run the cell on the tasks of a Slurm job (one rank "
                   "per task, nodes x tasks_per_node ranks)")
    @argument("--detach", action="store_true",
              help="with --executor: leave the Slurm job running on its own and return its handle; "
                   "ddp_notebook.follow(handle.folder) shows it from any kernel")
    @line_cell_magic  # (a line magic too, so that %ddp? shows this help as %%ddp? does)
    @no_var_expand  # (done below, only for a line that has something to expand)
    def ddp(self, line: str, cell: str | None = None):
        """Run this cell on every rank of a DDP job.

        In the cell, ``rank``, ``local_rank``, ``world_size`` and ``device`` are
        set, the process group is ready, and the notebook's names the cell uses
        (functions, classes, models, datasets) are there, shipped with cloudpickle.

        With no device flag: every GPU of the machine, or 2 CPU ranks without GPUs.
        ``--export train.py`` writes the cell as a script for torchrun instead of
        running it; ``--nnodes N --master-addr HOST`` runs this host's ranks as
        node 0 of a job on N hosts.
        """
        if "$" in line or "{" in line:  # IPython's $name and {expression}; its own expansion copies user_ns
            line = self.shell.var_expand(line, 2)  # (2: the cell's frame, below run_cell_magic and this)
        if cell is None:
            flags, code = _flags_and_code(self.ddp, line)
            if code.startswith("-"):  # a flag that did not parse (--seed abc): not code; the flags' error comes later
                flags, code = line.strip(), ""
            below = f", and {code} below it" if code else ""
            raise UsageError(f"%%ddp runs the cell below its line: write %%ddp{' ' + flags if flags else ''} "
                             f"as the cell's first line, with two %{below} (%ddp? shows its flags)")
        args = parse_flags(self.ddp, line)
        returns = _parse_returns(args.returns)
        if not cell.strip():
            raise UsageError("the %%ddp cell is empty: write the code the ranks should run below the %%ddp line")
        shell = self.shell
        filename, number = _this_cell(shell, line, cell)
        label = payload.cell_label(number)
        export_only = args.export is not None and args.nnodes == 1
        executor = _executor(shell, args.executor)
        warm = api.warm_pool_for(args.gpus, args.cpus, args.nnodes, export_only, executor)
        warm_as_found = (warm.group, warm.restarts) if warm is not None else None  # (an interrupt says what it kept)
        try:
            job_spec.check_options(args.port, args.seed, args.timeout, max_restarts=args.max_restarts,
                                   nnodes=args.nnodes, hang_after=args.hang_after)
            if not args.grace > 0:
                raise LaunchError(f"--grace must be a positive number of seconds, not {args.grace:g}")
            cell_reading.check_syntax(cell, 1, label)
            reading = cell_reading.read(cell)
            _check_node_flags(args, export_only)
            profile = profiling.checked(args.profile, nnodes=args.nnodes, executor=executor, detach=args.detach,
                                        export_only=export_only)
            targets = _parse_ranks(args.ranks, warm, reading, returns)
            if warm is not None:
                warm.refuse_job_options(port=args.port, timeout=args.timeout, backend=args.backend)
            names, shadowed = cell_reading.select_names(cell, shell.user_ns)
            for name in sorted(set(shadowed) - _told_shadowed):  # once per name, at the cell's line
                _told_shadowed.add(name)
                warnings.warn_explicit(f"in %%ddp cells {name!r} is the rank's own; the notebook's {name!r} is "
                                       f"not used", UserWarning, label, cell_reading.first_use(cell, name) + 1)
            _refuse_undefined(cell, shell.user_ns, warm, export_only)
            _refuse_unassigned_returns(reading, returns, names, warm)
            output_ranks = {0} if args.output == "0" else None
            spec = None if export_only else api.plan(  # (an export: the devices are torchrun's to give)
                warm, gpus=args.gpus, cpus=args.cpus, backend=args.backend, port=args.port, seed=args.seed,
                timeout=args.timeout, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                export=args.export, output_ranks=output_ranks, executor=executor, force=args.force, wait=args.wait)
        except LaunchError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:  # (reading the cell, planning: nothing was sent)
            raise _interrupted_before_start(warm, warm_as_found) from None
        try:
            written = f"%%ddp {line}\n{cell}"
            payload.hold_cell_text(filename, written, label)  # IPython holds the transformed call
            sources_version = None
            if warm is not None and not args.max_restarts:  # a restart's fresh ranks need every name and source
                warm.ensure_alive()  # ranks restarted now hold nothing: compare against those
                pool_ranks = targets if targets is not None else list(range(spec.world_size))
                names = warm.to_ship(names, pool_ranks)
                sources, sources_version = warm.sources_to_ship(pool_ranks)
            else:
                sources = payload.notebook_sources()
            sources.texts[filename] = written  # also where the sources' size limit left it out
            sources.labels[filename] = label
            task = payload.CellTask(cell, filename, 1, names, returns, sources,
                                    payload.future_features(getattr(shell.compile, "flags", 0)))
            if export_only:
                exported = exporting.write(task, args.export, run_dir=args.run_dir, seed=args.seed,
                                           timeout=args.timeout, backend=args.backend)
                print(exported.summary(args.cpus or _gpu_count(args.gpus) or "N"))
                return None
            if args.detach:
                return api.submit_detached(spec, task)
            relay, cell_log = background_relay(output_ranks) if args.background else (None, None)
            foreground = not args.background
            options = api.JobOptions(
                max_restarts=args.max_restarts, stop_grace=args.grace, keep_failed_rank=args.debug,
                callbacks=tuple(_metric_callbacks(shell, args)), profile=profile, profile_folder=args.log_dir,
                prompter=prompting.ask_in_notebook if foreground else None, show_where_interrupted=foreground,
                **({} if args.hang_after is None else {"hang_after": args.hang_after or None}))
            job = api.prepare_job(spec, task, options, on_pool=warm is not None, relay=relay, targets=targets,
                                  background=args.background, log_dir=args.log_dir)
        except BaseException as exc:
            if spec is not None:
                spec.release_devices()  # the job will not run: its GPUs go back now
            if isinstance(exc, LaunchError):
                raise UsageError(str(exc)) from None
            if isinstance(exc, KeyboardInterrupt) and not args.detach:  # (names pickled, the job made: nothing
                raise _interrupted_before_start(warm, warm_as_found) from None  # sent; a detached job may be queued)
            raise

        def settle(job):  # on a warm pool: what the ranks hold now, and recovery after a failure
            if warm is not None:
                bound = reading.bound  # a failed cell may have bound names too
                warm.hold_names(None if bound is None else bound | set(names))
                warm.cell_done(job, names, reading.assigned, shell.user_ns,
                               job.results[0].values if job.results and returns else None,
                               sources_version=sources_version)

        if args.background:
            return _start_in_background(shell, job, returns, cell_log, settle)
        try:
            api.start_job(job)
        except LaunchError as exc:
            raise UsageError(str(exc)) from None
        except KeyboardInterrupt:
            raise _interrupted_before_start(warm, warm_as_found) from None
        try:
            results = job.result()
        except KeyboardInterrupt:
            raise _interrupted_hard(job) from None
        except JobStopped as stopped:
            raise UsageError(str(stopped)) from None  # (one line: stopped from the debugger)
        except RankError:
            if args.debug and job.kept_rank is not None and job.kept_rank in job.group.alive:
                print(f"ddp_notebook: rank {job.kept_rank} waits at its failure: %ddp_debug opens the debugger "
                      f"there (the next job lets it go)", file=sys.stderr)
            raise
        finally:
            settle(job)
            profile_view.show(job)
        if job.stopped_text:
            if returns:
                shell.user_ns.update(results[0].values)
            raise CellStopped(job, list(results[0].values) if returns else [], results[0].missing if returns else [])
        if returns:
            _take_returns(shell, job, results)

    @magic_arguments()
    @argument("--gpus", default=None, metavar="N|I,J,..", help="a GPU count or indices, as for %%ddp")
    @argument("--cpus", type=int, default=None, metavar="N", help="N CPU ranks (gloo)")
    @argument("--backend", choices=("nccl", "gloo"), default=None, help="process-group backend")
    @argument("--force", action="store_true",
              help="with --gpus I,J: use GPUs another job has reserved (shared with it)")
    @argument("--wait", type=float, nargs="?", const=math.inf, default=None, metavar="MINUTES",
              help="with --gpus N: wait (up to MINUTES; no limit without) until N GPUs are free of other jobs' "
                   "reservations and load, first come first served")
    @argument("--port", type=int, default=None, metavar="P", help="master port (default: a free port)")
    @argument("--timeout", type=float, default=None, metavar="SECONDS", help="bound for each collective")
    @line_magic
    def ddp_start(self, line: str):
        """Start a warm pool: ranks and a process group that live across cells.

        Takes the device flags of ``%%ddp`` (``--gpus``, ``--cpus``, ``--backend``)
        and ``--port``/``--timeout``.  Every later ``%%ddp`` cell that names no
        devices runs on the pool and keeps its names; ``%ddp_stop`` ends it.
        """
        args = parse_flags(self.ddp_start, line)
        if pool_module.current() is not None:
            raise UsageError("a warm pool is already up (%ddp_status); %ddp_stop it first")
        try:
            job_spec.check_options(args.port, None, args.timeout)
            spec = job_spec.resolve_devices(args.gpus, args.cpus, args.backend, force=args.force, wait=args.wait,
                                            port=args.port, timeout=args.timeout)
            for note in spec.notes:
                print(f"ddp_notebook: {note}", file=sys.stderr)
            started = time.time()
            pool_module.Pool(spec).start()
        except LaunchError as exc:
            raise UsageError(str(exc)) from None
        where = f"GPUs {','.join(spec.gpus)}" if spec.gpus else "CPU"
        print(f"warm pool: {spec.world_size} {where} ranks ({spec.backend}) ready in {time.time() - started:.1f} s")

    @line_magic
    def ddp_status(self, line: str):
        """Show the warm pool's ranks: alive, device, memory."""
        warm = pool_module.current()
        if warm is None:
            print("no warm pool (start one with %ddp_start --cpus 2 or --gpus N)")
            return
        print(f"warm pool: {warm.spec.world_size} ranks, {warm.spec.backend}, port {warm.group.port}, "
              f"{warm.cells} cells run, {warm.restarts} restarts")
        for row in warm.status():
            memory = f"{row['rss'] / 2**20:.0f} MiB" if row["rss"] else "-"
            print(f"  rank {row['rank']}  pid {row['pid']}  {'alive' if row['alive'] else 'DEAD'}  "
                  f"{row['device']}  {memory}")

    @line_magic
    def ddp_stop(self, line: str):
        """End the warm pool's ranks and remove what they left, and stop the rank template."""
        rank_template.stop()  # the next cold job starts a new one
        warm = pool_module.current()
        if warm is None:
            print("no warm pool is up")
            return
        warm.stop()
        print("warm pool stopped")

    @line_magic
    def ddp_stacks(self, line: str):
        """Show where every rank of a running job is (its Python stack, ranks with the same stack together):
        ``%ddp_stacks`` for the latest running background job or the warm pool's, ``%ddp_stacks 3`` for job #3."""
        job = _running_job(line)
        if job is not None:
            print(f"job #{job.task_id}:\n{job.stacks()}")

    @line_magic
    def ddp_why(self, line: str):
        """Say why a running job is stuck: which ranks wait in which collective (torch's Flight Recorder), which
        rank has not joined it and where it is, which ranks finished already (``job.why()``).  ``%ddp_why`` for the
        latest running background job or the warm pool's, ``%ddp_why 3`` for job #3."""
        job = _running_job(line)
        if job is not None:
            print(f"job #{job.task_id}:\n{job.why()}")

    @line_magic
    def ddp_debug(self, line: str):
        """Open the debugger post mortem in the failing rank of the last failed job, as ``%debug`` does in the
        notebook: after ``%%ddp --debug`` or ``launch(..., debug=True)``, or a warm pool's last failed cell.
        ``u``/``d`` walk the rank's own traceback; quitting ends the rank (a warm pool keeps its ranks)."""
        job = engine_job.kept_failure()
        if job is None:
            print("no failed rank to debug: run the cell again with %%ddp --debug (a warm pool keeps its last "
                  "failed cell's failure until its next cell)")
            return
        print(f"ddp_notebook: rank {job.kept_rank} of job #{job.task_id}, at its failure")
        try:
            job.debug(prompter=prompting.ask_in_notebook)
        except (RuntimeError, KeyboardInterrupt) as exc:
            raise UsageError(str(exc)) from None

    @line_magic
    def ddp_jobs(self, line: str):
        """List this kernel's background jobs (``%%ddp --background``, ``launch(..., background=True)``)."""
        jobs = engine_job.background_jobs()
        if not jobs:
            print("no background jobs")
        for job in jobs:
            took = (job.ended_at or time.time()) - job.started_at
            print(f"job #{job.task_id}: {job.status}, {job.spec.world_size} ranks, {took:.0f} s")

    @line_magic
    def ddp_gpus(self, line: str):
        """Show the GPU picker: tick the GPUs (or, without GPUs, the CPU ranks) that
        ``%%ddp`` cells naming no devices use.  ``%ddp_gpus 0,1`` (or ``cpus 3``) chooses
        without widgets; ``%ddp_gpus off`` forgets the choice."""
        from . import picker

        arg = line.strip()
        if arg in ("off", "clear"):
            picker.forget()
            return None
        if arg:
            try:
                print(picker.choose(arg))
            except LaunchError as exc:
                raise UsageError(str(exc)) from None
            return None
        return picker.gpu_picker()


def _running_job(line: str):
    """The job ``%ddp_stacks``/``%ddp_why`` look at: the latest running background or warm-pool job, or job #N
    (``line``); None, said why, when there is none."""
    running = [job for job in engine_job.background_jobs() if job.status == "running"]
    warm = pool_module.current()
    if warm is not None and warm.busy is not None and warm.busy not in running:
        running.append(warm.busy)
    if line.strip():
        running = [job for job in running if str(job.task_id) == line.strip().lstrip("#")]
    if not running:
        print("no running background or warm-pool job" + (f" #{line.strip()}" if line.strip() else "")
              + " (a hung foreground cell: kill -USR2 <the kernel's pid>, see docs/long-runs.md; a foreground "
                "cell says why it is stuck by itself after --hang-after)")
        return None
    return running[-1]


def _notebook_value(shell, flag: str, name: str, hint: str = ""):
    """The notebook's object that a flag names (a builtin where the notebook has no such name), dotted attributes
    included (``--callback log.append``)."""
    head, *attributes = name.split(".")
    if head in shell.user_ns:
        value = shell.user_ns[head]
    elif hasattr(builtins, head):  # (print, as the notebook would find it)
        value = getattr(builtins, head)
    else:
        raise UsageError(f"{flag} {name}: no such name in the notebook or Python's builtins{hint}")
    try:
        for attribute in attributes:
            value = getattr(value, attribute)
    except AttributeError as exc:
        raise UsageError(f"{flag} {name}: {exc}") from None
    return value


def _executor(shell, name: str | None):
    """The notebook's submitit executor that ``--executor NAME`` names."""
    if name is None:
        return None
    return _notebook_value(shell, "--executor", name, " (make one with ex = submitit.AutoExecutor(folder=...))")


def _check_node_flags(args, export_only: bool) -> None:
    """Refuse flags that do not go together with --export, --nnodes, --executor or --detach."""
    job_spec.check_together(debug=args.debug, detach=args.detach, executor=args.executor, nnodes=args.nnodes,
                            flag=lambda name: "--" + name)
    if args.executor is not None:
        clash = [flag for flag, given in (("--export", args.export), ("--ranks", args.ranks),
                                          ("--run-dir", args.run_dir)) if given]
        if clash:
            raise LaunchError(f"--executor runs the cell as a Slurm job; {', '.join(clash)} do not go with it")
    if args.detach:
        clash = [flag for flag, given in (("--return", args.returns), ("--background", args.background),
                                          ("--callback", args.callbacks), ("--tensorboard", args.tensorboard))
                 if given]
        if clash:
            raise LaunchError(f"--detach returns at once and the job reports to files, not to this kernel; "
                              f"{', '.join(clash)} need the kernel to follow the job (ddp_notebook.follow shows a "
                              f"detached job's metrics)")
    if args.nnodes == 1:
        if args.node_rank != 0 or args.master_addr is not None:
            raise LaunchError("--node-rank and --master-addr go with --nnodes (a job on several hosts)")
    elif args.run_dir is not None:
        raise LaunchError("with --nnodes every node's ranks report to this notebook; --run-dir is where an "
                          "export run without a notebook writes its metrics")
    elif args.ranks is not None:
        raise LaunchError("--ranks runs a cell on some ranks of a warm pool, not on several hosts")
    if args.run_dir is not None and args.export is None:
        raise LaunchError("--run-dir goes with --export: where the exported script writes its metrics")
    if export_only:
        running = [flag for flag, given in (("--return", args.returns), ("--ranks", args.ranks),
                                            ("--background", args.background), ("--callback", args.callbacks),
                                            ("--tensorboard", args.tensorboard), ("--output", args.output != "all"),
                                            ("--debug", args.debug))
                   if given]
        if running:
            raise LaunchError(f"--export writes the cell as a script and does not run it; {', '.join(running)} "
                              f"need a run (with --nnodes, this host runs node 0 of the job)")


def _gpu_count(gpus: str | None) -> int | None:
    """How many GPUs ``--gpus`` names (for the torchrun command an export prints)."""
    if gpus is None:
        return None
    request = job_spec.parse_gpus(gpus)
    return request if isinstance(request, int) else len(request)


def _parse_ranks(text: str | None, warm, reading: cell_reading.CellReading, returns: list[str]) -> list[int] | None:
    if text is None:
        return None
    if warm is None:
        raise LaunchError("--ranks runs a cell on some ranks of a warm pool; start one with %ddp_start")
    try:
        targets = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise LaunchError(f"--ranks {text!r}: give rank numbers, as in 0 or 0,2") from None
    if not targets:
        raise LaunchError("--ranks: no rank given")
    if returns and 0 not in targets:
        raise LaunchError("--return copies names back from rank 0, which --ranks leaves out")
    if len(targets) < warm.spec.world_size:
        calls = reading.collectives
        if calls:
            raise LaunchError(f"this cell runs on rank(s) {', '.join(map(str, targets))} only, but calls "
                              f"{', '.join(calls)}: a collective needs every rank and would hang")
    return targets


class CellStopped(Stopped):
    """A graceful stop ended a ``%%ddp`` cell: what ``--return`` kept is in the notebook (see :class:`Stopped`)."""

    def __init__(self, job, returned: list[str], missing: list[str]):
        kept = f"; --return copied {', '.join(returned)} to the notebook" if returned else ""
        if missing:
            kept += f"; the cell had not assigned {', '.join(missing)} yet"
        super().__init__(job.stopped_text, kept)


def _interrupted_before_start(warm, as_found: tuple | None) -> KeyboardInterrupt:
    """The KeyboardInterrupt of a cell stopped before its ranks had its task: no rank ran any of it.  ``as_found``:
    the warm pool's (group, restarts) when the cell began, to tell whether its ranks are still those."""
    if warm is None:
        kept = ""
    elif warm.group is None:
        kept = "; the warm pool was stopped as it restarted (%ddp_start starts another)"
    elif (warm.group, warm.restarts) != as_found:
        kept = "; the warm pool's ranks were started anew meanwhile and hold nothing of earlier cells"
    else:
        dead = sorted(set(range(warm.spec.world_size)) - set(warm.group.alive))
        kept = (f"; rank(s) {', '.join(map(str, dead))} of the warm pool had died: the next cell restarts it" if dead
                else "; the warm pool's ranks keep their state (they never received the cell)")
    interrupt = KeyboardInterrupt(f"the %%ddp cell was interrupted before its ranks started it{kept}")
    interrupt._render_traceback_ = f"KeyboardInterrupt: {interrupt}".splitlines
    return interrupt


def _interrupted_hard(job) -> KeyboardInterrupt:
    """The KeyboardInterrupt of a cell stopped hard, shown as where its ranks were instead of the engine's frames
    (IPython renders an exception's ``_render_traceback_`` lines in place of its traceback)."""
    where = job.interrupted_where
    lines = "" if not where or job.interrupted_where_told else f"; where the ranks were:\n{where}"
    interrupt = KeyboardInterrupt(f"the %%ddp cell was stopped hard{lines}")
    interrupt._render_traceback_ = f"KeyboardInterrupt: {interrupt}".splitlines
    return interrupt


def _take_returns(shell, job, results: list) -> None:
    result = results[0]
    shell.user_ns.update(result.values)
    if result.missing:
        copied = f"; {', '.join(result.values)} copied back" if result.values else ""
        raise UsageError(f"--return: {_unassigned(job, results)}{copied}")


def _unassigned(job, results: list) -> str:
    """Why rank 0's result lacks names ``--return`` asked for: the names no rank assigned, and those only other
    ranks did (``--return`` copies rank 0's values), naming those ranks."""
    missing = results[0].missing
    assigned_by = {name: [rank for rank, result in zip(job.targets[1:], results[1:])
                          if result is None or name not in result.missing] for name in missing}
    nowhere = [name for name in missing if not assigned_by[name]]
    parts = [f"the cell never assigned {', '.join(nowhere)} on any rank"] if nowhere else []
    for name in missing:
        if assigned_by[name]:
            ranks = ", ".join(map(str, assigned_by[name]))
            parts.append(f"{name} was assigned on rank{'s' if len(assigned_by[name]) > 1 else ''} {ranks} but "
                         f"not on rank 0, whose values --return copies (assign it on rank 0 too, or send it there: "
                         f"torch.distributed.broadcast_object_list)")
    return "; ".join(parts)


def background_relay(output_ranks: set[int] | None = None):
    """Rank output of a background job goes to one output under its own cell, from any thread: (the relay, that
    output)."""
    from ..engine.output import OutputRelay
    from .cell_output import CellLog

    log = CellLog(max_lines=50)  # a tail: the dashboard below it should not move far down
    return OutputRelay(log, log, ranks=output_ranks), log


def _start_in_background(shell, job, returns: list[str], cell_log, settle):
    def finished(job):
        settle(job)
        if job.results is not None and returns:
            result = job.results[0]
            shell.user_ns.update(result.values)
            missing = f"; {_unassigned(job, job.results)}" if result.missing else ""
            how = job.stopped_text or "done"
            cell_log.write(f"[ddp_notebook] job #{job.task_id} {how}: {', '.join(result.values)} "
                                 f"copied into the notebook{missing}\n")
        elif job.stopped_text:
            cell_log.write(f"[ddp_notebook] job #{job.task_id} {job.stopped_text}\n")
        elif job.status == "failed":
            cell_log.write(f"[ddp_notebook] job #{job.task_id} failed: {job.error}\n")
        elif job.status == "stopped":
            cell_log.write(f"[ddp_notebook] {job.error}\n")

    job.on_done.append(finished)
    try:
        api.start_job(job, background=True)  # the cell returns at once (the job's thread waits for a template)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
    dashboard.attach(job)  # shown now, under this cell, with a Stop button
    return job.run_in_background()


def _this_cell(shell, line: str, cell: str) -> tuple[str, int]:
    """The name and number IPython gave the running cell, so rank tracebacks point into it: the file of the cell code
    that called the magic (a cell run again keeps its file, named by its code, so the newest file may be another)."""
    filename_map = getattr(shell.compile, "_filename_map", {})
    frame = sys._getframe(1)
    while frame is not None:  # this magic <- IPython's run_cell_magic <- the cell's code
        code = frame.f_code
        if code.co_name == "<module>" and code.co_filename in filename_map:
            entry = linecache.cache.get(code.co_filename)
            if entry and "run_cell_magic('ddp'" in "".join(entry[2][:1]):
                return code.co_filename, filename_map[code.co_filename]
            break  # called by other code (run_cell_magic in a function): a name of its own
        frame = frame.f_back
    number = shell.execution_count
    return shell.compile.cache(f"%%ddp {line}\n{cell}", number), number


def _show_rank_error(shell, etype, value, tb, tb_offset=None):
    """Show a rank's failure as the rank's own traceback, without the launcher's frames."""
    red, reset = "\x1b[0;31m", "\x1b[0m"
    lines = [f"{red}{etype.__name__}{reset}: {value.summary()}"]
    if value.note:
        lines.append(value.note)
    if value.failure.traceback:
        lines.append(f"--- traceback of rank {value.rank} ---")
        lines.append(value.shown_traceback())
    # IPython calls the handler but leaves showing the result to it.
    shell._showtraceback(etype, value, lines)
    return None


def _metric_callbacks(shell, args) -> list:
    """What ``--callback NAME`` and ``--tensorboard DIR`` ask for; the notebook process runs them."""
    found = []
    for name in args.callbacks:
        if name == "wandb" and name not in shell.user_ns:
            found.append(callbacks.WandB())
            continue
        value = _notebook_value(shell, "--callback", name)
        try:
            found.append(callbacks.resolve(value))
        except TypeError as exc:
            raise UsageError(f"--callback {name}: {exc}") from None
    if args.tensorboard:
        found.append(callbacks.TensorBoard(args.tensorboard))
    return found


def register(shell) -> None:
    shell.register_magics(DDPMagics)
    dashboard.install()
    if not shell.custom_exceptions:
        shell.set_custom_exc((RankError,), _show_rank_error)
