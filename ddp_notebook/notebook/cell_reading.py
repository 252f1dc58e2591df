"""What a cell reads and binds, told on the notebook side from its code: which notebook names a task carries,
which names nothing defines, what a ``--return`` can hold, what a warm pool's ranks hold after the cell, which
collectives it calls.  Every reading of a cell is here, over one parse of it (:func:`parsed`, cached); the magic
reads a cell once (:func:`read`) and hands what it found to the wire (the task's names) and to the warm pool.
"""
from __future__ import annotations

import ast
import builtins
import functools
from dataclasses import dataclass
from typing import Any

from ..wire.errors import LaunchError
from ..wire.payload import RANK_NAMES


@dataclass(frozen=True)
class CellReading:
    """One cell's names, read once."""

    bound: frozenset[str] | None  # what it binds in any scope; None: no reading can tell (import *, exec, globals())
    assigned: frozenset[str]  # what it binds at its top level: what the ranks hold after it
    collectives: tuple[str, ...]  # the collectives it obviously calls


def read(code: str) -> CellReading:
    """Read ``code`` (a cell, syntax checked) once, for every check of the magic and for the warm pool."""
    bound = scan_names(code)[0]
    return CellReading(None if bound is None else frozenset(bound), names_assigned(code), tuple(collective_calls(code)))


# Names IPython keeps in the user namespace that a cell never means to ship.
_IPYTHON_NAMES = {"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___", "_ih", "_oh", "_dh", "_ii", "_iii",
                  "_i"}

COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
    "reduce_scatter_tensor", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_reduce_metrics", "DistributedDataParallel", "DDP",
}

# A cell that calls these can bind names no reading of its code sees.
_DYNAMIC_NAMES = {"exec", "eval", "globals", "locals", "vars"}

_DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

@functools.lru_cache(maxsize=16)
def parsed(code: str) -> ast.Module:
    """The cell's syntax tree, parsed once for the notebook side's several readings of one cell (read it, never
    change it: it is shared).  Raises SyntaxError."""
    return ast.parse(code)

def check_syntax(code: str, line_offset: int, label: str) -> None:
    try:
        parsed(code)
    except SyntaxError as exc:
        line = (exc.lineno or 0) + line_offset
        text = (exc.text or "").rstrip()
        caret = ""
        if text and exc.offset:
            caret = "\n    " + " " * (exc.offset - 1 - (len(text) - len(text.lstrip()))) + "^"
        raise LaunchError(
            f"SyntaxError in {label}, line {line}: {exc.msg}\n    {text.strip()}{caret}\nNo rank was started."
        ) from None

@functools.lru_cache(maxsize=16)
def names_used(code: str) -> frozenset[str]:
    """Every name the code reads, anywhere (functions and comprehensions included)."""
    return frozenset(_names_read(parsed(code)))

def _names_read(tree: ast.AST) -> set[str]:
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            used.add(node.target.id)  # x += 1 reads x first
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            used.update(node.names)
    return used

@functools.lru_cache(maxsize=16)
def names_bound_first(code: str) -> frozenset[str]:
    """Names the code surely binds before it reads them (``log = open(...)`` or ``with open(...) as log:`` at its top
    level, before any use of ``log``): the cell's own, so a notebook value of that name is not sent.  A statement's
    reads count wherever they sit in it (a function it defines, a loop's body); binds count only where they surely
    happen: top-level assignments, imports, definitions and ``with ... as`` targets, not what an ``if``, a loop, a
    ``try`` or a ``with`` block binds."""
    bound, read = set(), set()

    def run(statements: list[ast.stmt], surely: bool) -> None:
        for statement in statements:
            if isinstance(statement, ast.With):
                for item in statement.items:
                    read.update(_names_read(item.context_expr) - bound)
                    if item.optional_vars is not None and surely:
                        bound.update(_names_stored(item.optional_vars) - read)
                run(statement.body, False)  # (a context manager may swallow an exception of its block)
                continue
            read.update(_names_read(statement) - bound)
            if surely:
                bound.update(_names_bound_by(statement) - read)

    run(parsed(code).body, True)
    return frozenset(bound)

def _names_bound_by(statement: ast.stmt) -> set[str]:
    if isinstance(statement, ast.Assign):
        return set().union(*(_names_stored(target) for target in statement.targets))
    if isinstance(statement, ast.AnnAssign) and statement.value is not None:
        return _names_stored(statement.target)
    if isinstance(statement, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in statement.names if alias.name != "*"}
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {statement.name}
    return set()

def _names_stored(target: ast.expr) -> set[str]:
    """The names an assignment target binds (``a``, ``a, (b, *c)``; not ``a.x`` or ``a[0]``, which read ``a``)."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_names_stored(element) for element in target.elts))
    if isinstance(target, ast.Starred):
        return _names_stored(target.value)
    return set()

def select_names(code: str, user_ns: dict) -> tuple[dict[str, Any], list[str]]:
    """The notebook names the cell reads (not those it binds before it reads them); and the rank names it would
    shadow."""
    used = names_used(code)
    shadowed = sorted(n for n in RANK_NAMES if n in used and n in user_ns)
    chosen = {}
    for name in used - names_bound_first(code):
        if name in RANK_NAMES or name in _IPYTHON_NAMES or name.startswith("_i") or name not in user_ns:
            continue
        if hasattr(builtins, name) and user_ns[name] is getattr(builtins, name):
            continue
        chosen[name] = user_ns[name]
    return chosen, shadowed

def _cell_level_definitions(node: ast.AST):
    """The functions and classes a cell defines outside any function or class (``if``/``for``/... included)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, _DEFINITIONS):
            yield child
        elif not isinstance(child, ast.expr):
            yield from _cell_level_definitions(child)

def scan_names(code: str) -> tuple[set[str] | None, dict[str, int]]:
    """What the cell binds, in any scope (None when no reading can tell: ``import *``, ``exec``, ``globals()``),
    and the names it reads with the cell line of their first use.

    Not counted as reads: annotations, which may never be evaluated, and the bodies of functions and
    classes the cell defines but never refers to, which may be meant for later cells.
    """
    bound, reads = _scan_names(code)
    return (None if bound is None else set(bound)), dict(reads)

@functools.lru_cache(maxsize=16)
def _scan_names(code: str) -> tuple[frozenset[str] | None, dict[str, int]]:
    tree = parsed(code)
    bound: set[str] | None = set()
    loads: list[ast.Name] = []
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            loads.append(node)
        elif isinstance(node, ast.Name):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, _DEFINITIONS):
            bound.add(node.name)
            if getattr(node, "returns", None) is not None:
                skip.add(id(node.returns))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
        elif not isinstance(node, ast.alias):  # except-as, match captures, type parameters
            name = getattr(node, "name", None) or getattr(node, "rest", None)
            if isinstance(name, str):
                bound.add(name)
        annotation = getattr(node, "annotation", None)
        if annotation is not None:
            skip.add(id(annotation))
    if "*" in bound or any(n.id in _DYNAMIC_NAMES for n in loads):
        bound = None
    for definition in _cell_level_definitions(tree):
        inside = {id(n) for n in ast.walk(definition)}
        if not definition.decorator_list and not any(n.id == definition.name and id(n) not in inside
                                                     for n in loads):
            skip.update(id(statement) for statement in definition.body)
    reads: dict[str, int] = {}
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if id(node) in skip:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            reads[node.id] = min(node.lineno, reads.get(node.id, node.lineno))
        stack.extend(ast.iter_child_nodes(node))
    return (None if bound is None else frozenset(bound)), reads

def undefined_names(code: str, defined) -> dict[str, int]:
    """The names the cell reads that nothing defines (name: cell line of first use).

    Defined: what the cell binds anywhere in it, ``defined`` (the notebook's names), the rank's names,
    builtins and dunder names.  Empty when the cell binds names dynamically (see :func:`scan_names`).
    """
    bound, reads = scan_names(code)
    if bound is None:
        return {}
    return {name: line for name, line in sorted(reads.items(), key=lambda item: item[1])
            if name not in bound and name not in defined and name not in RANK_NAMES
            and not hasattr(builtins, name) and not (name.startswith("__") and name.endswith("__"))}

def first_use(code: str, name: str) -> int:
    """The cell line where ``name`` first appears (1 when it does not as such)."""
    lines = [node.lineno for node in ast.walk(parsed(code))
             if isinstance(node, ast.Name) and node.id == name
             or isinstance(node, (ast.Global, ast.Nonlocal)) and name in node.names]
    return min(lines, default=1)

@functools.lru_cache(maxsize=16)
def names_assigned(code: str) -> frozenset[str]:
    """Names a cell binds at its top level (assignments, imports, defs, classes, loop targets)."""
    assigned: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            assigned.add(node.name)
            return
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            assigned.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                assigned.add((alias.asname or alias.name).split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(parsed(code))
    return frozenset(assigned)

def collective_calls(code: str) -> list[str]:
    """Obvious collective calls in the code (``dist.all_reduce(...)``, ``DDP(...)``, ...)."""
    found = []
    for node in ast.walk(parsed(code)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in COLLECTIVES:
                found.append(name)
    return sorted(set(found))
