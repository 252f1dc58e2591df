"""Cold jobs: what a job's ranks wait for before they run (issue 30), written to benchmarks/RESULTS_cold.md.

    python benchmarks/bench_cold.py [--repeats 8] [--before PATH] [--only fresh,bert,env,background] [--out FILE]

Three parts, contenders alternating (the order rotating every repeat), medians:

- a fresh script: ``launch()`` of the trivial job in a fresh python against torchrun, ``python -c "import torch"``,
  and, from a live process, ``launch()`` with the template warm and accelerate's ``notebook_launcher``;
- a kernel that has imported transformers and built a tiny BERT: a cold ``launch()`` and a ``%%ddp --cpus 2`` cell of
  a function that builds the same BERT on 2 ranks, against ``notebook_launcher`` in the same kernel;
- a changed environment (issue 35): a script and the BERT kernel change a variable before each cold ``launch()``
  (a user's, accelerate's launcher run first, one torch reads as it loads), against the same job unchanged
  (``--only env --out RESULTS_env.md`` writes this part alone);
- a ``%%ddp --background`` cell right after ``%load_ext ddp_notebook`` in a fresh kernel, timed from the client,
  and the time from its start to its job's end (its ranks forked once the template is ready, or started fresh);
- a notebook's own imports (``--only notebooks``): the quickstart's first cells and a trivial ``%%ddp`` cell, run
  back to back in a fresh kernel (scikit-learn sets ``KMP_*`` as it imports).

``--before PATH``: a folder holding an older ``ddp_notebook`` (e.g. ``git archive BASE ddp_notebook | tar -x -C
PATH``), measured alongside as "before" in the fresh-script, background and notebook parts.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

from jupyter_client.manager import start_new_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run  # noqa: E402  (its contenders: a fresh process per run, or one call in a live process)

ROOT = os.path.dirname(HERE)


class Before(run.Process):
    """A fresh process that imports the older ddp_notebook in ``path``."""

    def __init__(self, name, command, tmp, path):
        super().__init__(name, command, tmp)
        self.path = path

    def once(self) -> float:
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = self.path
        try:
            return super().once()
        finally:
            if saved is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = saved


def rounds(contenders: dict, repeats: int) -> dict[str, list[float]]:
    """Each contender (name -> a function returning seconds) once per round, the order rotating; one unrecorded
    round first."""
    names = list(contenders)
    for name in names:
        contenders[name]()
    times = {name: [] for name in names}
    for rep in range(repeats):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            times[name].append(contenders[name]())
    return times


def process_rounds(processes: list, repeats: int) -> dict[str, list[float]]:
    """:func:`rounds` of processes (``run.Process``, ``run.Caller``): each started first, stopped at the end."""
    for p in processes:
        p.start()
    try:
        return rounds({p.name: p.once for p in processes}, repeats)
    finally:
        for p in processes:
            p.stop()


def fresh_script(repeats: int, work: str, before: str | None) -> dict[str, list[float]]:
    def private(name):
        return tempfile.mkdtemp(prefix=f"{name}-", dir=work)

    processes = [
        run.Process("`python -c 'import torch'`", [run.PY, "-c", "import torch"], private("import")),
        run.Process("`launch()` in a fresh python", [run.PY, run.WORKLOADS, "launch-once"], private("fresh")),
        run.Process("torchrun --nproc-per-node 2",
                    lambda: run._torchrun() + ["--nproc-per-node", "2", "--master-port", str(run._free_port()),
                                               run.WORKLOADS, "torchrun-trivial"], private("torchrun")),
        run.Caller("`launch()` from a live process, template warm", "launch", private("warm")),
    ]
    if before:
        processes.append(Before("`launch()` in a fresh python, before", [run.PY, run.WORKLOADS, "launch-once"],
                                private("fresh_before"), before))
    if run._version("accelerate"):
        processes.append(run.Caller("accelerate `notebook_launcher` from a live process", "accelerate",
                                    private("accelerate")))
    return process_rounds(processes, repeats)


KERNEL_SETUP = r'''
%load_ext ddp_notebook
import os, socket, time
import ddp_notebook
import torch, transformers
from transformers import BertConfig, BertModel
from accelerate import notebook_launcher
from ddp_notebook.engine import template as _template

CONFIG = dict(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
BertModel(BertConfig(**CONFIG))  # the kernel has built one: what its ranks will import, it has imported

def tiny_bert():
    import torch
    import torch.distributed as dist
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**CONFIG))
    t = torch.ones(1)
    dist.all_reduce(t)
    return sum(p.numel() for p in model.parameters())

def tiny_bert_self_init():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    tiny_bert()
    dist.destroy_process_group()

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
'''

SETTLE = """
_template.preload_notebook_libraries()
assert _template.current().wait_ready()
_template.preload_notebook_libraries()  # as after any cell: what the kernel imported, preloaded
assert _template.current().wait_preloaded(timeout=300)
print("PRELOADED", len(_template.current().preloaded), "LEFT", _template.left_to_ranks())
"""

IN_CELL = """
_started = time.perf_counter()
{call}
print("TOOK", time.perf_counter() - _started)
"""

DDP_CELL = """%%ddp --cpus 2
import torch
import torch.distributed as dist
from transformers import BertConfig, BertModel
model = BertModel(BertConfig(**CONFIG))
t = torch.ones(1)
dist.all_reduce(t)
"""


def _cell(kc, code: str) -> tuple[float, str]:
    said = []
    started = time.perf_counter()
    reply = kc.execute_interactive(code, timeout=600, output_hook=lambda msg: said.append(
        msg["content"].get("text", "") if msg["msg_type"] == "stream" else
        "\n".join(msg["content"].get("traceback", [])) if msg["msg_type"] == "error" else ""))
    took = time.perf_counter() - started
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"{code!r} failed: {''.join(said)}")
    return took, "".join(said)


def _took(kc, call: str) -> float:
    return float(re.search(r"TOOK (\S+)", _cell(kc, IN_CELL.format(call=call))[1]).group(1))


def kernel_bert(repeats: int) -> tuple[dict[str, list[float]], str]:
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _cell(kc, KERNEL_SETUP)
        settled = _cell(kc, SETTLE)[1].strip()
        launcher = "notebook_launcher(tiny_bert_self_init, (), num_processes=2, use_port=str(free_port()))"
        contenders = {
            "cold `launch(tiny_bert, cpus=2)`, timed in the cell": lambda: _took(kc, "ddp_notebook.launch("
                                                                                     "tiny_bert, cpus=2)"),
            "accelerate `notebook_launcher`, timed in the cell": lambda: _took(kc, launcher),
            "`%%ddp --cpus 2` cell, timed from the client": lambda: _cell(kc, DDP_CELL)[0],
            "a cell calling `notebook_launcher`, timed from the client": lambda: _cell(kc, launcher)[0],
        }
        return rounds(contenders, repeats), settled
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def changed_environment_script(repeats: int, work: str) -> dict[str, list[float]]:
    """Live processes (a script, no cell ends) whose environment changes before every timed ``launch()``."""
    callers = [
        ("`launch()`, environment unchanged", "launch"),
        ("`launch()`, a user's variable changed before each", "launch-user-variable"),
        ("`launch()` after accelerate's `notebook_launcher` each time", "launch-after-accelerate"),
        ("`launch()`, a variable libtorch reads as it loads changed before each", "launch-torch-variable"),
        ("`launch()`, the same change, ranks started fresh (template off)", "launch-no-template-torch-variable"),
    ]
    if not run._version("accelerate"):
        callers = [c for c in callers if "accelerate" not in c[1]]
    processes = [run.Caller(name, kind, tempfile.mkdtemp(prefix=f"{kind}-", dir=work)) for name, kind in callers]
    return process_rounds(processes, repeats)


CHANGED_IN_CELL = {
    "cold `launch()`, environment unchanged": "",
    "cold `launch()`, a user's variable set in the same cell": "os.environ['WANDB_PROJECT'] = f'run-{time.time()}'",
    "cold `launch()` right after `notebook_launcher` in the same cell":
        "notebook_launcher(tiny_bert_self_init, (), num_processes=2, use_port=str(free_port()))",
    "cold `launch()`, `HF_HOME` (read by transformers at import) changed in the same cell":
        "_changes = globals().get('_changes', 0) + 1\n"
        "os.environ['HF_HOME'] = os.path.expanduser(f'~/.cache/huggingface-{_changes % 2}')",
    # the alternative: the same kind of change with fresh ranks, set back untimed (so no template is replaced)
    "cold `launch()`, the same kind of change, ranks started fresh (template off)":
        "_saved = os.environ.get('HF_HOME')\nos.environ['HF_HOME'] = os.path.expanduser('~/.cache/huggingface-x')\n"
        "os.environ['DDP_NOTEBOOK_TEMPLATE'] = '0'",
}
SET_BACK = """
del os.environ['DDP_NOTEBOOK_TEMPLATE']
if _saved is None:
    del os.environ['HF_HOME']
else:
    os.environ['HF_HOME'] = _saved
"""
TIMED_LAUNCH = """
{change}
_started = time.perf_counter()
ddp_notebook.launch(tiny_bert, cpus=2)
print("TOOK", time.perf_counter() - _started)
"""


def changed_environment_kernel(repeats: int) -> tuple[dict[str, list[float]], str]:
    """The BERT kernel: a cold ``launch()`` timed in a cell that first changed the environment."""
    km, kc = start_new_kernel(kernel_name="python3")
    try:
        _cell(kc, KERNEL_SETUP)
        settled = _cell(kc, SETTLE)[1].strip()

        def timed(change: str) -> float:
            took = float(re.search(r"TOOK (\S+)", _cell(kc, TIMED_LAUNCH.format(change=change))[1]).group(1))
            if "DDP_NOTEBOOK_TEMPLATE" in change:
                _cell(kc, SET_BACK)
            elif "HF_HOME" in change:  # a new template: its preloads must not weigh on the next contender
                _cell(kc, SETTLE)
            return took

        return rounds({name: (lambda c=c: timed(c)) for name, c in CHANGED_IN_CELL.items()}, repeats), settled
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


BACKGROUND = "%%ddp --background --cpus 2\npass"
TEMPLATE_STATE = "from ddp_notebook.engine import template as _t\nprint('READY', _t.current().wait_ready(timeout=0))"


def _machine_cpu_s() -> float:
    """CPU-seconds this machine has spent so far, every process included (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(f) for f in stat.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


# What a notebook runs between %load_ext and its first background cell: nothing (Run All of a cell right after it),
# or its own imports, as every notebook has (the template imports meanwhile).
BACKGROUND_CASES = {
    "right after `%load_ext`": None,
    "after the notebook's `import torch`": "import torch",
    # (the template then preloads them, one library at a time: a job waits for the one being imported)
    "after importing pandas, transformers and accelerate and setting two variables":
        "import os, torch, pandas, transformers, accelerate\nos.environ['WANDB_PROJECT'] = 'demo'\n"
        "os.environ['HF_HOME'] = os.path.expanduser('~/.cache/huggingface')",
}


def _background_once(path: str | None, first_cell: str | None) -> dict[str, float | bool | None]:
    """A fresh kernel: ``%load_ext``, ``first_cell`` if any, then a background cell: its time (execute → reply),
    the time and the machine's CPU from its start to its job's end (its ranks started and ran the task), whether
    the template was ready when the cell had returned, and the same cell's time once the template is ready."""
    env = dict(os.environ, PYTHONPATH=path) if path else None
    km, kc = start_new_kernel(kernel_name="python3", **({"env": env} if env else {}))
    try:
        _cell(kc, "%load_ext ddp_notebook")
        if first_cell:
            _cell(kc, first_cell)
        started, cpu = time.time(), _machine_cpu_s()  # (the kernel's clock is this machine's)
        cell = _cell(kc, BACKGROUND)[0]
        ready = "READY True" in _cell(kc, TEMPLATE_STATE)[1]
        said = _cell(kc, "import ddp_notebook\nddp_notebook.last_job().wait(timeout=300)\n"
                         "print('ENDED', ddp_notebook.last_job().ended_at)")[1]
        cpu = _machine_cpu_s() - cpu
        ended = float(said.split("ENDED", 1)[1].split()[0]) - started
        _cell(kc, "from ddp_notebook.engine import template as _t\n_t.ready_template().wait_preloaded()")
        later = _cell(kc, BACKGROUND)[0]
        _cell(kc, "ddp_notebook.last_job().wait(timeout=300)")
        return {"cell": cell, "ended": ended, "cpu": cpu, "later": later, "ready": ready}
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def background(repeats: int, before: str | None) -> tuple[dict[str, dict[str, list]], list[bool]]:
    """Per case and code (this one, and ``before``'s): each measure of :func:`_background_once` over the rounds."""
    found: dict[str, dict[str, list]] = {}
    contenders = {}
    for case, first_cell in BACKGROUND_CASES.items():
        for label, path in (("", None), (", before", before)) if before else (("", None),):
            def one_round(name=f"{case}{label}", path=path, first_cell=first_cell):
                measures = _background_once(path, first_cell)
                for measure, value in measures.items():
                    found.setdefault(name, {}).setdefault(measure, []).append(value)
                return measures["cell"]
            contenders[f"{case}{label}"] = one_round
    rounds(contenders, repeats)
    return {name: {m: v[1:] for m, v in measures.items()} for name, measures in found.items()}  # (rounds() runs
    #                                                                         each contender once, unrecorded, first)


QUICKSTART = os.path.join(ROOT, "notebooks", "quickstart.ipynb")
FIRST_JOB = "%%ddp --cpus 2\nx = torch.ones(1)"


def _quickstart_once(path: str | None) -> tuple[float, int]:
    """A fresh kernel runs the quickstart's first two cells (``%load_ext``; the data cell, which imports
    scikit-learn) and then a trivial ``%%ddp`` cell, back to back as Run All runs them: that cell's time from the
    client, and how many rank templates the kernel started."""
    env = dict(os.environ, DDP_NOTEBOOK_DEBUG="1", **({"PYTHONPATH": path} if path else {}))
    km, kc = start_new_kernel(kernel_name="python3", env=env)
    try:
        with open(QUICKSTART) as f:
            cells = ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"][:2]
        said = "".join(_cell(kc, cell)[1] for cell in cells)
        took, out = _cell(kc, FIRST_JOB)
        return took, (said + out).count("rank template starting")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def notebooks(repeats: int, before: str | None) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    templates: dict[str, list[int]] = {}

    def contender(name: str, path: str | None):
        def once() -> float:
            took, started = _quickstart_once(path)
            templates.setdefault(name, []).append(started)
            return took
        return once

    names = {"the quickstart's first `%%ddp` cell, Run All": None}
    if before:
        names["the quickstart's first `%%ddp` cell, Run All, before"] = before
    times = rounds({name: contender(name, path) for name, path in names.items()}, repeats)
    return times, {name: started[-repeats:] for name, started in templates.items()}


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1e3:.0f} ms ({min(values) * 1e3:.0f}–{max(values) * 1e3:.0f})"


def _ratio(times: dict, a: str, b: str) -> float:
    return statistics.median(times[a]) / statistics.median(times[b])


def _verdict(value: float, target: float) -> str:
    return f"{value:.2f}× (≤ {target}×: {'met' if value <= target else 'missed'})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--background-repeats", type=int, default=5)
    parser.add_argument("--before", help="a folder holding an older ddp_notebook, measured alongside")
    parser.add_argument("--only", default="fresh,bert,env,background,notebooks")
    parser.add_argument("--out", default="RESULTS_cold.md", help="the file under benchmarks/ to write")
    args = parser.parse_args()
    only = set(args.only.split(","))
    load_before = os.getloadavg()
    lines = ["# Cold jobs: what a job waits for before its ranks run", "",
             f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (load average "
             f"{load_before[0]:.1f} at the start), Python {platform.python_version()}, torch "
             f"{run._version('torch')}, transformers {run._version('transformers')}, accelerate "
             f"{run._version('accelerate')}. 2 CPU ranks (gloo); contenders alternating, the order rotating every "
             f"round; medians (min–max). `python benchmarks/bench_cold.py --repeats {args.repeats}"
             f"{' --before PATH' if args.before else ''}"
             f"{'' if args.only == parser.get_default('only') else ' --only ' + args.only}"
             f"{'' if args.out == parser.get_default('out') else ' --out ' + args.out}`.", ""]
    with tempfile.TemporaryDirectory(prefix="bench-cold-") as work:
        if "fresh" in only:
            times = fresh_script(args.repeats, work, args.before)
            lines += ["## A fresh script", "", "The trivial job (the group, one all-reduce) on 2 ranks; a fresh python "
                      "pays its interpreter, and `launch()` its template's `import torch` (it starts one and waits "
                      "until it has imported what every rank imports, not for `torch._dynamo`).", "",
                      "| contender | time |", "|---|---|"]
            lines += [f"| {name} | {_ms(v)} |" for name, v in times.items()]
            fresh, imp = "`launch()` in a fresh python", "`python -c 'import torch'`"
            lines += ["", f"- `launch()` in a fresh python / torchrun: "
                          f"{_verdict(_ratio(times, fresh, 'torchrun --nproc-per-node 2'), 0.5)}",
                      f"- `launch()` in a fresh python / `python -c 'import torch'`: "
                      f"{_verdict(_ratio(times, fresh, imp), 1.0)}"]
            acc = "accelerate `notebook_launcher` from a live process"
            if acc in times:
                lines.append(f"- `launch()` from a live process, template warm / accelerate: "
                             f"{_ratio(times, '`launch()` from a live process, template warm', acc):.2f}× "
                             f"(0.48× in RESULTS.md before this change)")
            if args.before:
                lines.append(f"- `launch()` in a fresh python, now / before: "
                             f"{_ratio(times, fresh, fresh + ', before'):.2f}×")
            lines.append("")
        if "bert" in only:
            times, settled = kernel_bert(args.repeats)
            lines += ["## A kernel that imported transformers", "",
                      "The kernel has imported transformers and built a tiny BERT (2 layers, hidden 32); the template "
                      f"has preloaded what it imported (`{settled}`). Each job builds the same BERT on 2 ranks and "
                      "all-reduces one tensor; a cold job: fresh ranks each time (no warm pool).", "",
                      "| contender | time |", "|---|---|"]
            lines += [f"| {name} | {_ms(v)} |" for name, v in times.items()]
            names = list(times)
            lines += ["", f"- cold `launch()` / `notebook_launcher`, in the cell: "
                          f"{_verdict(_ratio(times, names[0], names[1]), 2.0)}",
                      f"- `%%ddp --cpus 2` cell / a `notebook_launcher` cell, from the client: "
                      f"{_verdict(_ratio(times, names[2], names[3]), 2.0)}", ""]
        if "env" in only:
            times = changed_environment_script(args.repeats, work)
            unchanged = "`launch()`, environment unchanged"
            lines += ["## A changed environment, in a script", "",
                      "A live process changes its environment before each timed `launch()` of the trivial job (no "
                      "cell ends here, so nothing else makes a template). A variable only read when used reaches "
                      "ranks forked from the same template; one libtorch reads as it loads makes a new template, "
                      "which the job waits for (fresh ranks, the alternative, each import torch).", "",
                      "| contender | time | / unchanged |", "|---|---|---|"]
            lines += [f"| {name} | {_ms(v)} | {_ratio(times, name, unchanged):.2f}× |" for name, v in times.items()]
            lines += [""] + [f"- {name} / unchanged: {_verdict(_ratio(times, name, unchanged), 2.0)}"
                             for name in times if name != unchanged and "libtorch" not in name and "fresh" not in name]
            torch_variable = [name for name in times if "libtorch" in name]
            if torch_variable:
                fresh = "`launch()`, the same change, ranks started fresh (template off)"
                lines.append(f"- a variable libtorch reads as it loads, waiting for the new template / fresh ranks: "
                             f"{_ratio(times, torch_variable[0], fresh):.2f}×")
            times, settled = changed_environment_kernel(args.repeats)
            names = list(times)
            lines += ["", "## A changed environment, in a kernel that imported transformers", "",
                      f"The BERT kernel above (`{settled}`); each cell changes the environment, then times a cold "
                      "`launch(tiny_bert, cpus=2)`, as Run All runs such a cell. `HF_HOME` is read by "
                      "`huggingface_hub` as transformers imports: a new template (its preloads waited for "
                      "untimed after each round).", "",
                      "| contender | time | / unchanged |", "|---|---|---|"]
            lines += [f"| {name} | {_ms(v)} | {_ratio(times, name, names[0]):.2f}× |" for name, v in times.items()]
            lines += [""] + [f"- {name} / unchanged: {_verdict(_ratio(times, name, names[0]), 2.0)}"
                             for name in names[1:3]]
            lines += [f"- `HF_HOME` changed, waiting for the new template / fresh ranks: "
                      f"{_ratio(times, names[3], names[4]):.2f}×", ""]
        if "background" in only:
            found = background(args.background_repeats, args.before)
            lines += ["## A background cell right after `%load_ext`", "",
                      "A fresh kernel each round: `%load_ext ddp_notebook`, the notebook's `import torch` or "
                      "nothing, then `%%ddp --background --cpus 2` (the template imports meanwhile); the cell's "
                      "time from the client (execute → reply), the time from its start to its job's end (its "
                      "ranks started and ran the task) and the machine's CPU meanwhile (every process: the "
                      "template's own import of torch included), and the same cell once the template is ready "
                      "and done preloading.", "",
                      "| case | the cell | its job's end | the machine's CPU | template ready as the cell "
                      "returned | the cell, template ready |", "|---|---|---|---|---|---|"]
            for name, measures in found.items():
                lines += [f"| {name} | {_ms(measures['cell'])} | {_ms(measures['ended'])} | "
                          f"{statistics.median(measures['cpu']):.2f} CPU-s | {sum(measures['ready'])} of "
                          f"{len(measures['ready'])} | {_ms(measures['later'])} |"]
            median = statistics.median(found[next(iter(BACKGROUND_CASES))]["cell"])
            met = "met" if median <= 0.3 else "missed"
            lines += ["", f"- right after `%load_ext`: {median:.2f} s (≤ 0.3 s: {met})"]
            if args.before:
                for case in BACKGROUND_CASES:
                    now, then = (statistics.median(found[n]["ended"]) for n in (case, f"{case}, before"))
                    cpu_now, cpu_then = (statistics.median(found[n]["cpu"]) for n in (case, f"{case}, before"))
                    lines += [f"- {case}, the job's end: {now:.2f} s against {then:.2f} s before "
                              f"({now / then:.2f}×); the machine's CPU {cpu_now / cpu_then:.2f}×"]
            lines += [""]
        if "notebooks" in only:
            times, templates = notebooks(args.repeats, args.before)
            lines += ["## A notebook's own imports change the environment", "",
                      "A fresh kernel each round runs the quickstart's first two cells (`%load_ext ddp_notebook`; "
                      "the data cell, whose `import sklearn` sets `KMP_DUPLICATE_LIB_OK` and `KMP_INIT_AT_FORK` "
                      "where unset) and then a trivial `%%ddp --cpus 2` cell, back to back as Run All runs them; "
                      "that cell's time from the client, and the rank templates the kernel started.", "",
                      "| contender | time | templates started |", "|---|---|---|"]
            lines += [f"| {name} | {_ms(v)} | {', '.join(map(str, templates[name]))} |" for name, v in times.items()]
            if args.before:
                names = list(times)
                lines += ["", f"- the first `%%ddp` cell, now / before: {_ratio(times, names[0], names[1]):.2f}×"]
            lines.append("")
    path = os.path.join(HERE, args.out)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
