"""The live metrics dashboard in a real browser (JupyterLab + Debian Chromium via Playwright).

Runs notebooks/quickstart.ipynb (a copy) and checks, from the DOM, that the
dashboard is rendered as widgets (not the text fallback), that its figure changes
at least 3 times while the training cell runs, and that the cell ends with the
static PNG.  Screenshots go to artifacts/.  Skipped when the browser stack is
missing, except under CI=true, where that fails (see browser_support.py).
"""
import os
import re
import shutil

import pytest

from browser_support import (ROOT, Browser, JupyterLab, open_notebook, require_browser, run_all_cells, screenshot,
                             wait_for_text, wait_idle)
from ddp_notebook.notebook.dashboard import WIDGET_TEXT

QUICKSTART = os.path.join(ROOT, "notebooks", "quickstart.ipynb")

# Counts, per cell, the distinct src values of the dashboard's figure while it is shown.
COUNT_FIGURES = """() => {
  window.ddpFigures = {};
  const record = () => {
    document.querySelectorAll('.jp-Notebook .jp-Cell').forEach((cell, index) => {
      cell.querySelectorAll('.ddp-notebook-dashboard img').forEach((img) => {
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
def test_quickstart_shows_a_live_widget_dashboard(tmp_path):
    require_browser()
    if not os.path.exists(QUICKSTART):
        pytest.fail(f"{QUICKSTART} is missing")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(QUICKSTART, root / "quickstart.ipynb")  # the lab autosaves what it runs
    with JupyterLab(str(root)) as lab, Browser(str(tmp_path / "profile")) as page:
        open_notebook(page, lab, "quickstart.ipynb")
        page.evaluate(COUNT_FIGURES)
        run_all_cells(page)

        dashboard = page.locator(".jp-OutputArea-output .ddp-notebook-dashboard")
        dashboard.wait_for(timeout=120_000)
        # Rendered by the widget manager, not the text/plain fallback.
        assert "widget-vbox" in dashboard.get_attribute("class")
        status = dashboard.locator(".widget-html")
        assert status.count() == 1
        assert page.get_by_text(WIDGET_TEXT).count() == 0 and page.get_by_text("VBox(children=").count() == 0
        wait_for_text(status, r"ranks alive · epoch \d+/12", 60)
        figure = dashboard.locator(".widget-image")
        figure.wait_for(timeout=60_000)
        screenshot(dashboard, "dashboard_live.png")

        training_cell = page.locator(".jp-Notebook .jp-Cell", has=dashboard)
        final_png = training_cell.locator(".jp-RenderedImage img")
        final_png.wait_for(timeout=120_000)
        # The live dashboard gives way to the static figure (the status line is its title).
        assert re.search(r"done · \d+ ranks · epoch 12/12", status.text_content())
        dashboard.wait_for(state="hidden", timeout=10_000)
        counts = page.evaluate(FIGURE_COUNTS)
        index = page.evaluate("""() => [...document.querySelectorAll('.jp-Notebook .jp-Cell')]
                                     .findIndex((cell) => cell.querySelector('.ddp-notebook-dashboard'))""")
        assert counts.get(str(index), 0) >= 3, f"the live figure changed only {counts} times"
        assert re.search(r"\[rank 0\] trained for 12 epochs", training_cell.inner_text())  # prints stay visible

        wait_idle(page, 60)
        path = screenshot(training_cell.locator(".jp-OutputArea"), "dashboard_final.png")
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
