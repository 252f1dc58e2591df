"""Debugging a rank in a real browser (JupyterLab 4 and Notebook 7 + Debian Chromium via Playwright): a rank's
``breakpoint()`` shows its ``(Pdb rank 1)`` prompt in the notebook's input box under the cell; what is typed there
reaches the rank, and pdb's answer shows in the cell.  Screenshots: artifacts/debugger-{lab,notebook7}.png."""
import re
import time

import pytest

from browser_support import FRONTENDS, cells, notebook_run_in_browser, screenshot, wait_for_text, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.kernel, pytest.mark.browser]

CELLS = [
    "%load_ext ddp_notebook",
    "%%ddp --cpus 2\nsecret = 1000 + 7 * rank\nif rank == 1:\n    breakpoint()\nprint('after', rank, secret)",
]


def type_at_prompt(page, cell, prompt: str, line: str, timeout: float = 60.0) -> None:
    """Wait for the cell's input box asking ``prompt``, type ``line`` and press Enter (as a person does)."""
    box = cell.locator(".jp-Stdin", has_text=prompt).locator("input.jp-Stdin-input")
    deadline = time.monotonic() + timeout
    while not (box.count() and box.last.is_enabled() and box.last.is_visible()):
        if time.monotonic() > deadline:
            raise AssertionError(f"no input box asking {prompt!r} within {timeout:.0f} s; the cell shows:\n"
                                 f"{cell.inner_text()}")
        time.sleep(0.1)
    box.last.fill(line)
    box.last.press("Enter")


@pytest.mark.timeout(170)
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_a_ranks_breakpoint_is_answered_in_the_notebooks_input_box(tmp_path, frontend, no_leftovers):
    with notebook_run_in_browser(tmp_path, frontend, "debugger.ipynb", CELLS) as page:
        cell = cells(page).nth(1)
        type_at_prompt(page, cell, "(Pdb rank 1)", "p secret")
        wait_for_text(cell.locator(".jp-OutputArea"), r"\n1007\n", 60)  # rank 1's value, printed by its pdb
        screenshot(cell, f"debugger-{frontend}.png")
        type_at_prompt(page, cell, "(Pdb rank 1)", "c")
        wait_idle(page, 60)
        shown = cell.locator(".jp-OutputArea").inner_text()
        assert "[rank 0] after 0 1000" in shown and "[rank 1] after 1 1007" in shown, shown
        assert re.search(r"Cell In\[\d+\], line 5, in <module>\(\)", shown), shown
