"""The README's headline example and every docs page's examples run as written, in a real Jupyter kernel.

Each page's fenced code blocks are read in order; the ```python ones run, in ONE fresh kernel per page
(so a page may build on its earlier blocks, as a reader pasting them into one notebook would), with
the kernel's working directory in a temp dir.  What the fence's info string says after ``python``:

- nothing: the block must run without an error (no error output, no ``UsageError:`` line, no traceback
  in its printed output, which also catches a failing ``!torchrun``);
- ``raises=Name``: the block must end in an error named ``Name`` (a refusal the page shows on purpose;
  IPython prints a magic's ``UsageError`` on stderr instead of as an error output);
- ``no-run``: not run here (it needs GPUs, several hosts or a login); every page keeps at least one
  block that runs;
- ``answers="p x|c"``: the block may ask for input (a rank's ``input()`` or debugger): the front end
  allows stdin for it and types these lines, in order, at its input requests.

Other fences (```text, ```bash, ...) are not run.  The README's headline cell asks for ``--gpus 2``;
machines that run the tests may have no GPU, so for the README only ``--gpus 2`` is replaced by
``--cpus 2`` (the test checks that the replacement happened, so it notices when the example changes).

Static checks (no kernel): the README keeps the two set-up commands word for word, links every docs
page, and every relative link of the README and the pages points at a file (and heading) that exists.
"""
from __future__ import annotations

import os
import re
import shlex
import sys
import time
from pathlib import Path

import pytest

from nbrun import error, run_cells, run_cells_answering, text

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))

DEMO_COMMAND = "pip install torch==2.13.0 -e '.[demo]' && python -m ddp_notebook demo"
TEST_COMMAND = "pip install torch==2.13.0 -e '.[test]' && python -m pytest"

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def blocks(path: Path) -> list[tuple[str, str, int]]:
    """(info string, code, line) of each fenced block of the page, in order."""
    source = path.read_text()
    return [(m.group(1).strip(), m.group(2), source.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(source)]


def runnable(path: Path) -> list[tuple[str, str | None, int]]:
    """(code, expected error name or None, line) of the ```python blocks to run."""
    return [(code, expected, line) for code, expected, line, _ in _runnable(path)]


def _runnable(path: Path) -> list[tuple[str, str | None, int, list[str]]]:
    """(code, expected error name or None, line, the answers to type) of the ```python blocks to run."""
    found = []
    for info, code, line in blocks(path):
        words = shlex.split(info)
        if not words or words[0] != "python" or "no-run" in words[1:]:
            continue
        expected = next((w.split("=", 1)[1] for w in words[1:] if w.startswith("raises=")), None)
        typed = next((w.split("=", 1)[1].split("|") for w in words[1:] if w.startswith("answers=")), [])
        found.append((code.rstrip("\n"), expected, line, typed))
    return found


def readme_cells() -> list[tuple[str, str | None, int]]:
    cells = runnable(README)
    # This machine may have no GPU: run the headline cell on 2 CPU ranks instead (the only change made).
    swapped = [(code.replace("--gpus 2", "--cpus 2"), expected, line) for code, expected, line in cells]
    assert swapped != cells, "the README's headline cell no longer says --gpus 2: update this test"
    return swapped


def raised(cell) -> str | None:
    """The name of the error the cell ended in, or None.  IPython shows a magic's ``UsageError`` as a
    ``UsageError: ...`` line on stderr rather than as an error output."""
    err = error(cell)
    if err is not None:
        return err.ename
    for out in cell.outputs:
        if out.output_type == "stream" and out.name == "stderr" and re.search(r"^UsageError: ", out.text, re.M):
            return "UsageError"
    return None


def run_page(cells: list[tuple[str, str | None, int]], where: Path, cwd: Path,
             answers: dict[int, list[str]] | None = None) -> None:
    started = time.monotonic()
    if answers:
        nb, _ = run_cells_answering([code for code, _, _ in cells], answers, timeout=120, cwd=str(cwd))
    else:
        nb, _ = run_cells([code for code, _, _ in cells], timeout=120, cwd=str(cwd))
    problems = []
    for cell, (code, expected, line) in zip(nb.cells, cells):
        got = raised(cell)
        head = f"{where.name}, block at line {line}"
        if expected is None and (got is not None or "Traceback (most recent call last)" in text(cell)):
            problems.append(f"{head} failed:\n{code}\n---\n{text(cell)}")
        elif expected is not None and got != expected:
            problems.append(f"{head} should raise {expected}, got {got or 'no error'}:\n{code}\n---\n{text(cell)}")
    assert not problems, "\n\n".join(problems)
    print(f"{where.name}: {len(cells)} blocks in {time.monotonic() - started:.1f} s")


@pytest.fixture
def kernel_env(monkeypatch):
    # As in an activated virtualenv: `!torchrun` and `!python` in a page find the kernel's own Python.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.slow
@pytest.mark.kernel
def test_the_readme_headline_example_runs(tmp_path, kernel_env, no_leftovers):
    run_page(readme_cells(), README, tmp_path)


@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_the_examples_of_a_docs_page_run(page, tmp_path, kernel_env, no_leftovers):
    answers = {i: typed for i, (_, _, _, typed) in enumerate(_runnable(page)) if typed}
    run_page(runnable(page), page, tmp_path, answers)


# -- static checks: no kernel ------------------------------------------------------------------------


def test_every_docs_page_has_an_example_that_runs():
    assert PAGES, "no docs pages found"
    for page in PAGES:
        assert any(expected is None for _, expected, _ in runnable(page)), f"{page.name}: no runnable example"
    assert runnable(README), "README: the headline example is not a runnable ```python block"


def test_the_readme_keeps_the_two_set_up_commands_word_for_word():
    commands = [code.strip() for info, code, _ in blocks(README) if info == "bash"]
    assert DEMO_COMMAND in commands
    assert TEST_COMMAND in commands


def test_the_readme_links_every_docs_page():
    source = README.read_text()
    for page in PAGES:
        assert f"](docs/{page.name}" in source, f"README does not link docs/{page.name}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except - and _, spaces to -."""
    anchors, seen = set(), {}
    inside_fence = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            inside_fence = not inside_fence
        if inside_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [README, *PAGES], ids=["README", *[p.stem for p in PAGES]])
def test_relative_links_point_at_what_exists(path):
    source = FENCE.sub("", path.read_text())
    broken = []
    for target in LINK.findall(source):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(target)
    assert not broken, f"{path.name}: broken links {broken}"
