"""The GPU picker in a real browser: JupyterLab + Debian's Chromium driven by Playwright.

The kernel gets the recorded 8-GPU inventory (tests/fake_nvml.py); the test
checks that the panel renders as widgets (not the text fallback), clicks two
GPU checkboxes in the page, and reads back -- from the DOM -- that the kernel
now resolves cells that name no devices to the new GPUs.  A screenshot goes to
artifacts/gpu_picker.png.  Skipped when Chromium, Playwright or JupyterLab is
missing, except under CI=true, where that fails.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import nbformat
import pytest

from conftest import ROOT

TESTS = os.path.dirname(os.path.abspath(__file__))
CHROMIUM = "/usr/lib/chromium/chromium"
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def _missing() -> str | None:
    if not os.path.exists(CHROMIUM):
        return f"Debian Chromium not found at {CHROMIUM} (apt-get install chromium)"
    for module, package in (("playwright.sync_api", "playwright"), ("jupyterlab", "jupyterlab"),
                            ("jupyterlab_widgets", "ipywidgets")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed (pip install {package}; never `playwright install`)"
    return None


def _require_browser() -> None:
    why = _missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test cannot run under CI=true: {why}")
    pytest.skip(why)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _write_notebook(path: str) -> None:
    cells = [
        f"import sys; sys.path.insert(0, {TESTS!r})\n"
        "import fake_nvml\n"
        "from ddp_notebook import gpus, launcher\n"
        "gpus._nvml_override = fake_nvml.server8()  # the recorded 8x A100 server\n"
        "%load_ext ddp_notebook",
        "%ddp_gpus",
        "spec = launcher.resolve_devices()\nprint('DEFAULT', spec.world_size, ','.join(spec.gpus), spec.backend)",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)


class _Lab:
    """A JupyterLab server of its own (own config, settings and runtime dirs), stopped with its kernels."""

    def __init__(self, root: str):
        self.root = root
        self.port = _free_port()
        self.token = os.urandom(12).hex()
        config = os.path.join(root, ".jupyter-config")
        os.makedirs(os.path.join(config, "labconfig"))
        with open(os.path.join(config, "labconfig", "page_config.json"), "w") as f:
            json.dump({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}, f)
        env = dict(os.environ, JUPYTER_CONFIG_DIR=config, JUPYTER_RUNTIME_DIR=os.path.join(root, ".runtime"))
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self.log = open(os.path.join(root, "lab.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={root}", "--LabApp.news_url=None", "--ServerApp.port_retries=0",
             f"--LabApp.user_settings_dir={os.path.join(root, '.settings')}",
             f"--LabApp.workspaces_dir={os.path.join(root, '.workspaces')}"],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.url('api/status')}", timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"JupyterLab did not start:\n{self.output()}")
                time.sleep(0.2)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def output(self) -> str:
        with open(self.log.name, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)  # the server's own session: it and its kernels
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self.log.close()


def _wait_for_text(locator, pattern: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if locator.count():
            last = locator.first.inner_text()
            if re.search(pattern, last):
                return last
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} did not appear; last text: {last!r}")


@pytest.mark.timeout(150)
def test_picker_renders_and_clicks_reach_the_kernel(tmp_path):
    _require_browser()
    from playwright.sync_api import sync_playwright

    root = tmp_path / "lab"
    root.mkdir()
    _write_notebook(str(root / "picker.ipynb"))
    artifacts = os.path.join(ROOT, "artifacts")
    os.makedirs(artifacts, exist_ok=True)
    lab = _Lab(str(root))
    try:
        with sync_playwright() as pw:
            context = pw.chromium.launch_persistent_context(
                str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000})
            try:
                page = context.pages[0] if context.pages else context.new_page()
                page.set_default_timeout(30_000)
                page.goto(lab.url("lab/tree/picker.ipynb"))
                page.wait_for_selector(".jp-Notebook .jp-Cell")
                _wait_for_text(page.locator("#jp-main-statusbar"), r"\| Idle", 60)

                page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
                page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()

                panel = page.locator(".jp-OutputArea-output .ddp-gpu-picker")
                panel.wait_for()
                assert page.get_by_text("VBox(children=").count() == 0  # widgets rendered, not the text fallback
                boxes = panel.locator(".widget-checkbox input[type=checkbox]")
                assert boxes.count() == 8
                assert [boxes.nth(i).is_checked() for i in range(8)] == [i in (1, 3, 6) for i in range(8)]
                assert "NVIDIA A100-SXM4-80GB" in panel.inner_text() and "71.3/80 GiB, 97%" in panel.inner_text()
                summary = panel.locator(".ddp-picker-summary")
                _wait_for_text(summary, r"3 ranks on GPU 1, 3, 6 \(nccl\)")
                last_cell = page.locator(".jp-Notebook .jp-Cell").nth(2)
                _wait_for_text(last_cell.locator(".jp-OutputArea-output"), r"DEFAULT 3 1,3,6 nccl")

                # Click in the page: tick GPU 0, untick GPU 6.  The summary is written by the kernel.
                panel.locator(".ddp-gpu-0 input[type=checkbox]").click()
                panel.locator(".ddp-gpu-6 input[type=checkbox]").click()
                _wait_for_text(summary, r"3 ranks on GPU 0, 1, 3 \(nccl\)")
                panel.locator(".ddp-gpu-7 input[type=checkbox]").click()
                _wait_for_text(summary, r"4 ranks on GPU 0, 1, 3, 7 \(nccl\)")

                # Run the last cell again: the launcher in the kernel now resolves to the clicked GPUs.
                last_cell.locator(".jp-InputArea-editor").click()
                page.keyboard.press("Control+Enter")
                _wait_for_text(last_cell.locator(".jp-OutputArea-output"), r"DEFAULT 4 0,1,3,7 nccl")
                _wait_for_text(page.locator("#jp-main-statusbar"), r"\| Idle", 30)
                panel.scroll_into_view_if_needed()
                page.screenshot(path=os.path.join(artifacts, "gpu_picker.png"), full_page=True)
            finally:
                context.close()
    except BaseException:
        print(lab.output(), file=sys.stderr)
        raise
    finally:
        lab.stop()


@pytest.mark.timeout(10)
def test_a_missing_browser_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="Debian Chromium not found at /nonexistent/chromium"):
        _require_browser()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="cannot run under CI=true: Debian Chromium not found"):
        _require_browser()
