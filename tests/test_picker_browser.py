"""The GPU picker in a real browser: JupyterLab 4 and Notebook 7 + Debian's Chromium driven by Playwright.

The kernel gets the recorded 8-GPU inventory (tests/fake_nvml.py); the test
checks that the panel renders as widgets (not the text fallback), clicks GPU
checkboxes in the page, and reads back -- from the DOM -- that the kernel now
resolves cells that name no devices to the new GPUs.  Once per front end; screenshots
go to artifacts/gpu_picker-{lab,notebook7}.png.  Skipped when Chromium, Playwright,
JupyterLab or Notebook 7 is missing, except under CI=true, where that fails (see browser_support.py).
"""
import os

import pytest

from browser_support import FRONTENDS, cells, notebook_run_in_browser, screenshot, wait_for_text, wait_idle


TESTS = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.slow, pytest.mark.kernel, pytest.mark.browser]


CELLS = [
    f"import sys; sys.path.insert(0, {TESTS!r})\n"
    "import fake_nvml\n"
    "from ddp_notebook.engine import devices as gpus, spec as job_spec\n"
    "gpus._nvml_override = fake_nvml.server8()  # the recorded 8x A100 server\n"
    "%load_ext ddp_notebook",
    "%ddp_gpus",
    "spec = job_spec.resolve_devices()  # ranks get GPU UUIDs: shown as the recorded GPUs' indices\n"
    "print('DEFAULT', spec.world_size, ','.join(str(fake_nvml.UUIDS.index(g)) for g in spec.gpus), spec.backend)",
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("frontend", list(FRONTENDS))
def test_picker_renders_and_clicks_reach_the_kernel(tmp_path, frontend):
    with notebook_run_in_browser(tmp_path, frontend, "picker.ipynb", CELLS) as page:
        panel = page.locator(".jp-OutputArea-output .ddp-gpu-picker")
        panel.wait_for()
        assert page.get_by_text("VBox(children=").count() == 0  # widgets rendered, not the text fallback
        boxes = panel.locator(".widget-checkbox input[type=checkbox]")
        assert boxes.count() == 8
        assert [boxes.nth(i).is_checked() for i in range(8)] == [i in (1, 3, 6) for i in range(8)]
        assert "NVIDIA A100-SXM4-80GB" in panel.inner_text() and "71.3/80 GiB, 97%" in panel.inner_text()
        summary = panel.locator(".ddp-picker-summary")
        wait_for_text(summary, r"3 ranks on GPU 1, 3, 6 \(nccl\)")
        last_cell = cells(page).nth(2)
        wait_for_text(last_cell.locator(".jp-OutputArea-output"), r"DEFAULT 3 1,3,6 nccl")

        # Click in the page: tick GPU 0, untick GPU 6.  The summary is written by the kernel.
        panel.locator(".ddp-gpu-0 input[type=checkbox]").click()
        panel.locator(".ddp-gpu-6 input[type=checkbox]").click()
        wait_for_text(summary, r"3 ranks on GPU 0, 1, 3 \(nccl\)")
        panel.locator(".ddp-gpu-7 input[type=checkbox]").click()
        wait_for_text(summary, r"4 ranks on GPU 0, 1, 3, 7 \(nccl\)")

        # Run the last cell again: the launcher in the kernel now resolves to the clicked GPUs.
        last_cell.locator(".jp-InputArea-editor").click()
        page.keyboard.press("Control+Enter")
        wait_for_text(last_cell.locator(".jp-OutputArea-output"), r"DEFAULT 4 0,1,3,7 nccl")
        wait_idle(page, 30)
        panel.scroll_into_view_if_needed()
        screenshot(page, f"gpu_picker-{frontend}.png")
