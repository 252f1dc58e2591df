"""A background job's Stop button, clicked in a real browser (JupyterLab 4 and Notebook 7 + Debian Chromium via
Playwright).  Screenshots: artifacts/background_stopped-{lab,notebook7}.png."""
import re

import pytest

from browser_support import FRONTENDS, cells, notebook_run_in_browser, screenshot, wait_for_text, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.kernel, pytest.mark.browser]

CELLS = [
    "%load_ext ddp_notebook",
    "%%ddp --cpus 2 --background\nimport time\nfrom ddp_notebook import report\n"
    "for epoch in range(1, 10_000):\n    time.sleep(0.2)\n    report(epoch=epoch, loss=1.0 / epoch)",
    "job = _\nprint('meanwhile the kernel is free:', job.status)",
]


@pytest.mark.timeout(170)
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_the_stop_button_stops_a_background_job(tmp_path, frontend):
    with notebook_run_in_browser(tmp_path, frontend, "background.ipynb", CELLS) as page:
        wait_for_text(cells(page).nth(2), r"meanwhile the kernel is free: running", 120)
        status = cells(page).nth(1).locator(".jp-RenderedText", has_text="ddp_notebook · ")
        status.wait_for(timeout=60_000)
        wait_for_text(status, r"epoch [3-9]", 60)  # training goes on while the kernel is idle
        assert "stop it: the Stop button, or _2.stop()" in status.inner_text()
        button = cells(page).nth(1).locator(".ddp-notebook-stop")
        assert button.is_visible()
        button.click()
        wait_for_text(status, r"stopped", 20)
        screenshot(cells(page).nth(1), f"background_stopped-{frontend}.png")
        wait_idle(page, 30)
        # The kernel sees it too: run one more cell that reads the job.
        cells(page).nth(2).click()
        page.keyboard.press("Shift+Enter")
        wait_for_text(cells(page).nth(2), r"meanwhile the kernel is free: stopped", 30)
        assert not button.is_visible()
        assert re.search(r"stopped", status.inner_text())
