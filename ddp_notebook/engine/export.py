"""Export a cell or a function as a standalone script that runs under torchrun.

``export(fn, "train.py")`` and ``%%ddp --export train.py`` write, and do not run:

* ``train.py``: a short script that finds its files beside itself (from any
  working directory) and hands over to :mod:`ddp_notebook.runner`;
* ``train.payload.pkl``: the task, pickled as for a job (the cell's code and
  the notebook objects it uses; notebook-defined functions and classes by value);
* ``train.arrays.bin``: big tensors and arrays, written once and memory-mapped
  by every rank (only when there are some);
* ``train.manifest.json``: the Python minor, torch, cloudpickle and ddp_notebook
  versions of the notebook, which the script checks before it unpickles anything.

Notebook side; the versions are read the same way on both sides.
"""
from __future__ import annotations

import json
import os
import pickle
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..wire import payload, safe_files, sharing
from ..wire.errors import LaunchError
from ..wire.versions import FORMAT, versions
from .spec import call_arguments, check_options



@dataclass
class Exported:
    """The files of an export, and how to run them."""

    script: str
    payload: str
    manifest: str
    arrays: str | None
    run_dir: str | None  # None: beside the script, wherever it runs

    def commands(self, nproc: Any = "N", master_addr: str = "HOST", port: Any = "PORT", nnodes: int = 2) -> str:
        script = self.script
        return "\n".join([
            f"  one machine:        torchrun --nproc-per-node {nproc} {script}",
            f"  node I of {nnodes}, static: torchrun --nnodes {nnodes} --node-rank I --nproc-per-node {nproc} "
            f"--master-addr {master_addr} --master-port {port} {script}",
            f"  {nnodes} nodes, c10d:      torchrun --nnodes {nnodes} --nproc-per-node {nproc} --rdzv-backend c10d "
            f"--rdzv-endpoint {master_addr}:{port} --rdzv-id RUN {script}",
        ])

    def summary(self, nproc: Any = "N") -> str:
        parts = [f"exported {self.script} (payload {_size(self.payload)}"
                 + (f", arrays {_size(self.arrays)} memory-mapped by the ranks" if self.arrays else "") + ")"]
        parts.append("run it with torchrun (from any directory, on hosts with the same versions):")
        parts.append(self.commands(nproc))
        where = self.run_dir or os.path.dirname(self.script)
        parts.append(f"metrics go to {where}/metrics-node*.jsonl; watch them in a notebook with "
                     f"ddp_notebook.follow({where!r})")
        return "\n".join(parts)

    def __repr__(self) -> str:
        return self.summary()


def _size(path: str) -> str:
    n = os.path.getsize(path)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def paths(script: str) -> dict[str, str]:
    """The files of the export whose script is ``script``, all beside it."""
    stem = script[:-3] if script.endswith(".py") else script
    return {"payload": stem + ".payload.pkl", "manifest": stem + ".manifest.json", "arrays": stem + ".arrays.bin"}


def _new_temp(directory: str, name: str, mode: int = 0o600) -> tuple[int, str]:
    """A new file of this process's beside ``name`` in ``directory``, under a name no one can guess (its descriptor,
    its path): never a file another user put there first, never through a link (``safe_files.new_temp``)."""
    return safe_files.new_temp(os.path.join(directory, os.path.basename(name)), mode)


class ExportFolderWarning(safe_files.SharedFolderWarning):
    """The folder of an export is writable by other users."""


def _put(temp: str, path: str) -> None:
    """Give the file ``temp`` its name ``path``; another user's file there (a sticky folder) is named."""
    try:
        os.replace(temp, path)
    except PermissionError:
        st = os.lstat(path)
        raise LaunchError(f"--export: cannot replace {path}: it is {safe_files.user_name(st.st_uid)}'s, in a folder "
                          f"where only its owner may replace it; export to another path") from None


class _ArrayFile(sharing.Store):
    """The pickler's store for an export: big arrays are appended to one file beside the payload.

    The references it makes name that file (by its base name), and the ranks map
    it copy-on-write (:func:`ddp_notebook.wire.sharing.map_export_arrays`); the notebook's own memory is never moved.
    """

    def __init__(self, directory: str, name: str):
        super().__init__(via_proc=False)
        self.directory = directory
        self.path: str | None = None  # written here (made on the first array), then renamed to ``name``
        self.name = name
        self.size = 0
        self._fd: int | None = None

    def move_block(self, addr: int, nbytes: int, owner: Any) -> None:
        return None

    def copy_block(self, addr: int, nbytes: int) -> tuple:
        if self._fd is None:
            self._fd, self.path = _new_temp(self.directory, self.name)
        offset = (self.size + sharing.ALIGN - 1) // sharing.ALIGN * sharing.ALIGN
        sharing.write_at(self._fd, addr, nbytes, offset)
        self.size = offset + nbytes
        self.bundle.stats["disk"] += nbytes
        return (0, -1, sharing.EXPORT_REF, self.name), offset

    def close(self) -> bool:
        """True when something was written."""
        if self._fd is None:
            return False
        os.close(self._fd)
        self._fd = None
        return True


def write(task: Any, path: str, *, run_dir: str | None = None, seed: int | None = None,
          timeout: float | None = None, backend: str | None = None, notebook: dict | None = None,
          rank_options: dict | None = None) -> Exported:
    """Write the export of ``task`` (a CellTask or CallTask) with its script at ``path``.

    ``notebook``: the channel of a notebook that runs node 0 of this job (address,
    key, task id); its ranks and every other node's connect back to it.
    ``rank_options``: for a scheduler's run (``results_to_files``: each rank's
    return value beside the metrics files; ``remove_after_load``: the last rank
    to load the task removes the export).
    """
    script = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not script.endswith(".py"):
        raise LaunchError(f"--export {path}: the export is a Python script; give a path ending in .py")
    if os.path.isdir(script):
        raise LaunchError(f"--export {path} is a directory")
    if backend is not None and backend not in ("nccl", "gloo"):
        raise LaunchError(f"backend must be 'nccl' or 'gloo', not {backend!r}")
    directory = os.path.dirname(script)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"--export {path}: cannot create {directory}: {exc.strerror}") from None
    files = paths(script)
    label = task_label(task)
    run_dir = os.path.abspath(os.path.expanduser(os.fspath(run_dir))) if run_dir is not None else None
    # Other users could replace or remove its files (the payload every rank unpickles) between the export and its run.
    safe_files.warn_if_shared(directory, directory, "another user could replace the export's files before it runs "
                             "(the payload is code every rank runs)", "export into a folder only you can write",
                             ExportFolderWarning)
    store = _ArrayFile(directory, os.path.basename(files["arrays"]))
    temps = []  # made here: removed unless renamed to their names
    try:
        try:
            data = payload.dumps_with(task, store)
        except Exception:
            store.close()
            payload.dumps(task, share=False)  # names the notebook object that cannot be pickled, if it is one
            raise
        finally:
            if store.path is not None:
                temps.append(store.path)
        has_arrays = store.close()
        run = {"format": FORMAT, "task": data, "arrays": os.path.basename(files["arrays"]) if has_arrays else None,
               "seed": seed, "timeout": timeout, "backend": backend, "notebook": notebook, **(rank_options or {})}
        fd, payload_tmp = _new_temp(directory, files["payload"])  # 0600: it may hold a job key
        temps.append(payload_tmp)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(run, f, protocol=4)
        if has_arrays:
            _put(store.path, files["arrays"])
        elif os.path.exists(files["arrays"]):
            os.unlink(files["arrays"])  # from an earlier export to this path
        _put(payload_tmp, files["payload"])
        manifest = {
            "format": FORMAT, "versions": versions(), "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
            "payload": os.path.basename(files["payload"]), "run_dir": run_dir, "label": label,
            "multi_node_notebook": notebook is not None,
            # Where the notebook imports from: modules it uses by name are found there on a host that has them.
            "sys_path": [p or os.getcwd() for p in sys.path],
        }
        fd, manifest_tmp = _new_temp(directory, files["manifest"], 0o644)
        temps.append(manifest_tmp)
        with os.fdopen(fd, "w") as f:
            json.dump(manifest, f, indent=1)
        _put(manifest_tmp, files["manifest"])
        fd, script_tmp = _new_temp(directory, script, 0o755)
        temps.append(script_tmp)
        with os.fdopen(fd, "w") as f:
            f.write(_script_text(os.path.basename(files["manifest"]), label, manifest))
        _put(script_tmp, script)
    finally:
        for leftover in temps:
            if os.path.exists(leftover):
                os.unlink(leftover)
    return Exported(script, files["payload"], files["manifest"], files["arrays"] if has_arrays else None, run_dir)


def export(fn_or_task: Callable | payload.CellTask | payload.CallTask, path: str, args: tuple = (),
           kwargs: dict | None = None, *, run_dir: str | None = None, seed: int | None = None,
           timeout: float | None = None, backend: str | None = None) -> Exported:
    """Write ``fn(*args, **kwargs)`` as a script for torchrun (plus its payload, beside it); does not run it.

    Under torchrun every rank calls the function with the process group ready and
    ``ddp_notebook.rank_context()`` set, exactly as ``launch`` would; ``report()``
    appends to ``metrics-node<I>.jsonl`` in ``run_dir`` (default: beside the
    script), which :func:`ddp_notebook.follow` shows.  ``seed`` seeds every rank
    before the call, ``timeout`` bounds each collective, ``backend`` overrides the
    default (nccl with CUDA, else gloo).
    """
    if isinstance(fn_or_task, (payload.CellTask, payload.CallTask)):
        task = fn_or_task
    elif callable(fn_or_task):
        args, kwargs = call_arguments("export", args, kwargs)
        task = payload.CallTask(fn_or_task, args, kwargs, False, payload.sources_for(fn_or_task))
    else:
        raise LaunchError(f"export takes a function (or a task), not {type(fn_or_task).__name__}")
    check_options(None, seed, timeout)
    return write(task, path, run_dir=run_dir, seed=seed, timeout=timeout, backend=backend)


def task_label(task: Any) -> str:
    """How the script's docstring names what it runs."""
    if isinstance(task, payload.CellTask):
        return f"the notebook cell {task.sources.labels.get(task.filename, '')}".rstrip()
    return f"the function {getattr(task.fn, '__qualname__', repr(task.fn))}"


_SCRIPT = '''#!/usr/bin/env python3
"""Exported by ddp_notebook {version} on {date}: {label}.

Run it with torchrun, from any directory, on hosts with the versions in
{manifest} (Python {python}, torch {torch}, cloudpickle {cloudpickle}):

    torchrun --nproc-per-node N {name}
    torchrun --nnodes 2 --node-rank I --nproc-per-node N --master-addr HOST --master-port PORT {name}
    torchrun --nnodes 2 --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN {name}

Without torchrun it runs as a single process.  Option: --run-dir DIR, where
report() writes metrics-node<I>.jsonl (default: {run_dir}).
Keep the files named in {manifest} beside this script.
"""
import json
import os
import sys

MANIFEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), {manifest!r})

if __name__ == "__main__":
    try:
        from ddp_notebook.rank import torchrun as runner
    except ImportError as exc:
        with open(MANIFEST) as f:
            exported = json.load(f)["versions"]
        sys.exit(f"ddp_notebook: cannot import ddp_notebook in this Python ({{sys.executable}}, "
                 f"{{sys.version.split()[0]}}): {{exc}}\\nThis script needs "
                 + ", ".join(f"{{name}} {{version}}" for name, version in exported.items()))
    sys.exit(runner.main(MANIFEST, sys.argv[1:]))
'''


def _script_text(manifest_name: str, label: str, manifest: dict) -> str:
    found = manifest["versions"]
    script_name = manifest_name[: -len(".manifest.json")] + ".py"
    return _SCRIPT.format(
        label=label, date=manifest["exported_at"],
        version=found["ddp_notebook"], manifest=manifest_name, python=found["python"], torch=found["torch"],
        cloudpickle=found["cloudpickle"], name=script_name,
        run_dir=manifest["run_dir"] or "beside this script",
    )
