"""The package's shape: sides, one-way flow, no import loop (lazy imports included), no private names read across
modules.  Read from the source (every import statement, wherever it sits), so a lazy import counts too."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

import ddp_notebook

PACKAGE = os.path.dirname(ddp_notebook.__file__)
# What each side may import from the package.  The flow: notebook -> engine -> wire <- rank.
ALLOWED = {
    "wire": {"wire", "version"},
    "rank": {"rank", "wire", "version"},
    "engine": {"engine", "wire", "version"},
    "notebook": {"notebook", "engine", "wire", "api", "version"},
    "api": {"engine", "wire", "api", "notebook", "version"},
}
HEAVY_VIEWS = ("IPython", "ipywidgets", "matplotlib")


def _modules() -> dict[str, str]:
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return found


MODULES = _modules()


def _imports(module: str, path: str, tree: ast.AST | None = None) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import statement of ``module`` (or of ``tree``,
    read as if it were ``module``'s source)."""
    tree = tree if tree is not None else ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [alias.name for alias in node.names]
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in MODULES]
            found += [(s, [], node.lineno) for s in submodules]
            rest = [n for n in names if f"{target}.{n}" not in MODULES]
            if rest or not submodules:
                found.append((target, rest, node.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    """Every module's imports of the package, the package root (``import ddp_notebook``, ``from .. import x``) too."""
    graph = {}
    for module, path in MODULES.items():
        graph[module] = {target for target, _, _ in _imports(module, path) if target in MODULES and target != module}
    return graph


def _side(module: str) -> str | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package's front (ddp_notebook/__init__.py): may reach everything, lazily
    return parts[1] if parts[1] in ALLOWED or parts[1] == "version" else None


def _side_imported(target: str) -> str | None:
    """The side an import reaches; the package root is the front, as ``api`` is."""
    return "api" if target == "ddp_notebook" else _side(target)


def _loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                item = stack.pop()
                on_stack.discard(item)
                component.add(item)
                if item == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return loops


def test_no_import_loop_anywhere_lazy_imports_included():
    assert _loops(_graph()) == []


@pytest.mark.parametrize("spelling", ["import ddp_notebook", "from .. import attempt", "from ddp_notebook import report",
                                      "import ddp_notebook as package"])
def test_an_import_of_the_package_root_counts_in_the_loop_check(spelling):
    # The root imports engine.template (lazily, for %load_ext): a template that imports the root closes a loop.
    module, path = "ddp_notebook.engine.template", MODULES["ddp_notebook.engine.template"]
    tree = ast.parse(f"def fingerprint():\n    {spelling}\n")
    graph = _graph()
    graph[module] = graph[module] | {target for target, _, _ in _imports(module, path, tree) if target in MODULES}
    assert ["ddp_notebook", module] in [[m for m in loop if m in ("ddp_notebook", module)] for loop in _loops(graph)]


def test_data_flows_one_way_between_the_sides():
    wrong = []
    for module, path in MODULES.items():
        side = _side(module)
        if side is None or side == "version":
            continue
        for target, _, line in _imports(module, path):
            if target not in MODULES:
                continue
            if _side_imported(target) not in ALLOWED[side]:
                wrong.append(f"{module}:{line} imports {target}")
    assert wrong == []


# A rank's rich output: display() and plt.show() in a cell render with IPython's formatters and matplotlib, so
# these two import them, inside functions that only a cell calling display() runs, or (mpl_backend) in a module
# that only matplotlib loads; test_a_rank_starts_without_ipython_widgets_or_matplotlib holds the start to none of them.
RICH_OUTPUT = {"ddp_notebook.rank.display", "ddp_notebook.rank.mpl_backend"}


def test_the_rank_side_and_the_wire_never_import_views():
    wrong = [f"{module}:{line} imports {target}" for module, path in MODULES.items()
             if _side(module) in ("rank", "wire", "engine") and module not in RICH_OUTPUT
             for target, _, line in _imports(module, path) if target.split(".")[0] in HEAVY_VIEWS]
    assert wrong == []


def test_no_module_reads_another_modules_private_names():
    wrong = []
    for module, path in MODULES.items():
        tree = ast.parse(open(path).read(), path)
        aliases = {}  # local name -> package module
        for target, names, line in _imports(module, path):
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    wrong.append(f"{module}:{line} imports {target}.{name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level or isinstance(node, ast.ImportFrom) and \
                    (node.module or "").startswith("ddp_notebook"):
                for alias in node.names:
                    for target, _, _ in _imports(module, path):
                        if target.endswith("." + alias.name) and target in MODULES:
                            aliases[alias.asname or alias.name] = target
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                wrong.append(f"{module}:{node.lineno} reads {aliases[node.value.id]}.{node.attr}")
    assert wrong == []


def test_a_rank_starts_without_ipython_widgets_or_matplotlib():
    code = ("import sys, ddp_notebook, ddp_notebook.rank.worker, ddp_notebook.rank.torchrun, ddp_notebook.rank.data, "
            "ddp_notebook.rank.checkpoint\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_VIEWS!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MPLBACKEND": ""})
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("entry", ["ddp_notebook.worker", "ddp_notebook.runner"])
def test_the_entry_points_of_earlier_versions_still_exist(entry):
    assert entry in MODULES


def test_debug_logging_shows_the_engines_lifecycle():
    code = ("import ddp_notebook\n"
            "def f():\n    return 1\n"
            "print(ddp_notebook.launch(f, cpus=2))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "DDP_NOTEBOOK_DEBUG": "1"})
    assert out.stdout.strip() == "[1, 1]", out.stderr
    for step in ("ranks started: LocalRanks", "job #1 started on LocalRanks: 2 ranks, port", "rank 0: hello",
                 "rank 1: result", "exited with 0", "job #1 ended: done", "ranks stopped"):
        assert step in out.stderr, (step, out.stderr)


# What the notebook side and the front door may set on an object not their own `self`: objects they made themselves.
OWN_OBJECTS = {
    ("ddp_notebook.notebook.dashboard", "watcher._view_chosen"),  # its own Watcher
    ("ddp_notebook.notebook.dashboard", "status.ended_at"),  # its own Status
    ("ddp_notebook.notebook.dashboard", "status.outcome"),
    ("ddp_notebook.notebook.dashboard", "status.restart"),
    ("ddp_notebook.notebook.magic", "interrupt._render_traceback_"),  # the KeyboardInterrupt it raises
    ("ddp_notebook.notebook.picker", "_active.summary.value"),  # its own picker's widgets
    ("ddp_notebook.notebook.picker", "previous.summary.value"),
}


def test_the_notebook_side_never_sets_the_attributes_of_the_engines_objects():
    """A job, its spec, a pool, a relay are configured through their constructors and methods (``JobOptions``,
    ``resolve_devices(port=...)``, ``pool.hold_names``, ``relay.log_to``), never by setting their attributes from
    the notebook side or the front door."""
    wrong = []
    for module, path in MODULES.items():
        if _side(module) != "notebook" and module != "ddp_notebook.api":
            continue
        for node in ast.walk(ast.parse(open(path).read(), path)):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                    root = item
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    if isinstance(item, ast.Attribute) and not (isinstance(root, ast.Name) and root.id == "self") \
                            and (module, ast.unparse(item)) not in OWN_OBJECTS:
                        wrong.append(f"{module}:{node.lineno} sets {ast.unparse(item)}")
    assert wrong == []
