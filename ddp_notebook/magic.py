"""The ``%%ddp`` cell magic: turn a cell into a task and hand it to the launcher."""
from __future__ import annotations

import linecache
import warnings

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from . import dashboard, launcher, payload
from .errors import LaunchError, RankError


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
    @argument("--port", type=int, default=None, metavar="P",
              help="master port (default: a free port for each job)")
    @argument("--seed", type=int, default=None, metavar="S",
              help="seed python, numpy and torch identically on every rank before the cell runs")
    @argument("--timeout", type=float, default=None, metavar="SECONDS",
              help="bound for each collective (passed to init_process_group)")
    @argument("--return", dest="returns", default=None, metavar="a,b",
              help="names assigned in the cell to copy back from rank 0 (tensors to CPU, DDP unwrapped)")
    @argument("--output", choices=("all", "0"), default="all", help="show every rank's output, or rank 0's only")
    @argument("--callback", dest="callbacks", action="append", default=[], metavar="NAME",
              help="a callable in the notebook (or wandb) that gets each reported record, reduced over ranks")
    @argument("--tensorboard", default=None, metavar="DIR", help="write the reported metrics to TensorBoard in DIR")
    @cell_magic
    def ddp(self, line: str, cell: str):
        """Run this cell on every rank of a DDP job.

        In the cell, ``rank``, ``local_rank``, ``world_size`` and ``device`` are
        set, the process group is ready, and the notebook's names the cell uses
        (functions, classes, models, datasets) are there, shipped with cloudpickle.

        With no device flag: every GPU of the machine, or 2 CPU ranks without GPUs.
        """
        args = parse_argstring(self.ddp, line)
        returns = _parse_returns(args.returns)
        if not cell.strip():
            raise UsageError("the %%ddp cell is empty: write the code the ranks should run below the %%ddp line")
        shell = self.shell
        filename, number = _this_cell(shell, line, cell)
        try:
            launcher.check_options(args.port, args.seed, args.timeout)
            payload.check_syntax(cell, 1, f"Cell In[{number}]")
            names, shadowed = payload.select_names(cell, shell.user_ns)
            for name in shadowed:
                warnings.warn(f"in %%ddp cells {name!r} is the rank's own; the notebook's {name!r} is not used",
                              stacklevel=2)
            spec = launcher.resolve_devices(args.gpus, args.cpus, args.backend)
            spec.port, spec.seed, spec.timeout = args.port, args.seed, args.timeout
            spec.output_ranks = {0} if args.output == "0" else None
            sources = payload.notebook_sources()
            sources.texts[filename] = f"%%ddp {line}\n{cell}"  # IPython holds the transformed call
            sources.labels[filename] = f"Cell In[{number}]"
            task = payload.CellTask(cell, filename, 1, names, returns, sources)
            results = launcher.run_job(spec, task, callbacks=_metric_callbacks(shell, args))
        except LaunchError as exc:
            raise UsageError(str(exc)) from None
        if returns:
            shell.user_ns.update(results[0].values)
            if results[0].missing:
                copied = f"; {', '.join(results[0].values)} copied back" if results[0].values else ""
                raise UsageError(f"--return: the cell never assigned {', '.join(results[0].missing)}{copied}")

    @line_magic
    def ddp_gpus(self, line: str):
        """Show the GPU picker: tick the GPUs (or, without GPUs, the CPU ranks) that
        ``%%ddp`` cells naming no devices use.  ``%ddp_gpus off`` forgets the choice."""
        from . import picker

        arg = line.strip()
        if arg in ("off", "clear"):
            picker.forget()
            return None
        if arg:
            raise UsageError("%ddp_gpus takes no argument, or 'off' to forget the picker's choice")
        return picker.gpu_picker()


def _this_cell(shell, line: str, cell: str) -> tuple[str, int]:
    """The name and number IPython gave the running cell, so rank tracebacks point into it."""
    filename_map = getattr(shell.compile, "_filename_map", {})
    if filename_map:
        filename, number = max(filename_map.items(), key=lambda item: item[1])
        entry = linecache.cache.get(filename)
        if entry and "run_cell_magic('ddp'" in "".join(entry[2][:1]):
            return filename, number
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
        lines.append(value.failure.traceback.rstrip())
    # IPython calls the handler but leaves showing the result to it.
    shell._showtraceback(etype, value, lines)
    return None


def _metric_callbacks(shell, args) -> list:
    """What ``--callback NAME`` and ``--tensorboard DIR`` ask for; the notebook process runs them."""
    from . import callbacks

    found = []
    for name in args.callbacks:
        head, *attributes = name.split(".")
        if head not in shell.user_ns:
            if name == "wandb":
                found.append(callbacks.WandB())
                continue
            raise UsageError(f"--callback {name}: no such name in the notebook")
        value = shell.user_ns[head]
        try:
            for attribute in attributes:  # --callback log.append
                value = getattr(value, attribute)
            found.append(callbacks.resolve(value))
        except (AttributeError, TypeError) as exc:
            raise UsageError(f"--callback {name}: {exc}") from None
    if args.tensorboard:
        found.append(callbacks.TensorBoard(args.tensorboard))
    return found


def register(shell) -> None:
    shell.register_magics(DDPMagics)
    dashboard.install()
    if not shell.custom_exceptions:
        shell.set_custom_exc((RankError,), _show_rank_error)
