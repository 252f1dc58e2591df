"""The live metrics dashboard in a real browser (JupyterLab 4 and Notebook 7 + Debian Chromium via Playwright).

Runs notebooks/quickstart.ipynb (a copy) and checks, from the DOM, that the
dashboard is rendered as plain outputs (a text status and a PNG, no widgets), that
its figure changes at least 3 times while the training cell runs, and that the
cell ends with the final figure, titled with the final status.  Once per front end;
screenshots go to artifacts/dashboard_{live,final}-{lab,notebook7}.png.  Skipped when the browser stack is
missing, except under CI=true, where that fails (see browser_support.py).
"""
import os
import re
import shutil

import pytest

from browser_support import (FRONTENDS, ROOT, Browser, JupyterServer, open_notebook, require_browser, run_all_cells, screenshot,
                             wait_for_text, wait_idle)

QUICKSTART = os.path.join(ROOT, "notebooks", "quickstart.ipynb")

# Counts, per cell, the distinct src values of the dashboard's figure while it is shown.
COUNT_FIGURES = """() => {
  window.ddpFigures = {};
  const record = () => {
    document.querySelectorAll('.jp-Notebook .jp-Cell').forEach((cell, index) => {
      cell.querySelectorAll('.jp-RenderedImage img').forEach((img) => {
        if (img.src && img.offsetParent !== null) {
          (window.ddpFigures[index] = window.ddpFigures[index] || new Set()).add(img.src);
        }
      });
    });
  };
  new MutationObserver(record).observe(document.body,
    {subtree: true, childList: true, attributes: true, attributeFilter: ['src', 'style']});
}"""
FIGURE_COUNTS = "() => Object.fromEntries(Object.entries(window.ddpFigures).map(([k, v]) => [k, v.size]))"


@pytest.mark.timeout(170)
@pytest.mark.slow
@pytest.mark.kernel
@pytest.mark.browser
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_quickstart_shows_a_live_dashboard_without_widgets(tmp_path, frontend):
    require_browser()
    if not os.path.exists(QUICKSTART):
        pytest.fail(f"{QUICKSTART} is missing")
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(QUICKSTART, root / "quickstart.ipynb")  # the front end autosaves what it runs
    with JupyterServer(str(root), frontend) as server, Browser(str(tmp_path / "profile")) as page:
        open_notebook(page, server, "quickstart.ipynb")
        page.evaluate(COUNT_FIGURES)
        run_all_cells(page)

        status = page.locator(".jp-OutputArea-output.jp-RenderedText", has_text="ddp_notebook · ")
        status.wait_for(timeout=120_000)
        wait_for_text(status, r"ranks alive · epoch \d+/12", 60)
        training_cell = page.locator(".jp-Notebook .jp-Cell", has=status)
        figure = training_cell.locator(".jp-RenderedImage img")
        figure.wait_for(timeout=60_000)
        assert training_cell.locator("[class*='widget-']").count() == 0  # no widget manager involved
        screenshot(training_cell.locator(".jp-OutputArea"), f"dashboard_live-{frontend}.png")

        wait_for_text(status, r"done · \d+ ranks · epoch 12/12", 120)
        assert figure.count() == 1  # updated in place: the outputs did not grow
        counts = page.evaluate(FIGURE_COUNTS)
        index = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')]
                                     .findIndex((cell) => cell.innerText.includes('ddp_notebook · '))""")
        assert counts.get(str(index), 0) >= 3, f"the live figure changed only {counts} times"
        assert re.search(r"\[rank 0\] trained for 12 epochs", training_cell.inner_text())  # prints stay visible

        wait_idle(page, 60)
        path = screenshot(training_cell.locator(".jp-OutputArea"), f"dashboard_final-{frontend}.png")
        assert os.path.getsize(path) > 10_000


@pytest.mark.timeout(10)
def test_a_missing_browser_skips_with_how_to_enable_and_fails_under_ci(monkeypatch):
    import browser_support

    monkeypatch.setattr(browser_support, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Chromium not found at /nonexistent/chromium; to run the "
                                                    "browser tests: apt-get install chromium"):
        require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="cannot run under CI=true: Chromium not found"):
        require_browser()
