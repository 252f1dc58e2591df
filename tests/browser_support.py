"""Drive notebooks in a real browser: JupyterLab 4 or Notebook 7 + Debian's Chromium through Playwright.

    require_browser()                      # skip (or, under CI=true, fail) when something is missing
    with JupyterServer(root, "notebook7") as server, Browser(profile_dir) as page:   # or "lab"
        open_notebook(page, server, "quickstart.ipynb")
        run_all_cells(page)
        wait_idle(page)
        screenshot(page, "quickstart-notebook7.png")   # -> artifacts/quickstart-notebook7.png

Tests run once per front end in ``FRONTENDS``.  Both are the same JupyterLab
components (the DOM classes, the Run menu and its commands are shared); they differ
in the server app (``python -m jupyterlab`` / ``python -m notebook``), its settings
(``--LabApp.*`` / ``--JupyterNotebookApp.*``) and the notebook's URL (``lab/tree/``
/ ``notebooks/``).  Notebook 7 has no status bar, so ``wait_idle`` asks the page's
own kernel connection (the server exposes the app as ``window.jupyterapp``).

Facts behind the details are in ../shared/notes/browser-testing.md: Chromium
stalls without the flags below and a fresh profile; Playwright's ``launch()``
refuses ``--user-data-dir``; the server needs ``--allow-root`` as root, its own
config (the news toast covers the page otherwise) and its own session, so the
server and its kernels stop together.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARTIFACTS = os.path.join(ROOT, "artifacts")
CHROMIUM = os.environ.get("DDP_NOTEBOOK_CHROMIUM", "/usr/lib/chromium/chromium")
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]
HOW_TO_ENABLE = ("to run the browser tests: apt-get install chromium (Debian's, at /usr/lib/chromium/chromium, "
                 "or set DDP_NOTEBOOK_CHROMIUM) and pip install jupyterlab notebook ipywidgets playwright "
                 "(never `playwright install`)")

# The front ends the browser tests run in: name -> (server module, its app's settings class, notebook URL prefix).
FRONTENDS = {
    "lab": ("jupyterlab", "LabApp", "lab/tree/"),           # JupyterLab 4
    "notebook7": ("notebook", "JupyterNotebookApp", "notebooks/"),  # Notebook 7
}


def missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if not os.path.exists(CHROMIUM):
        return f"Chromium not found at {CHROMIUM}"
    for module, package in (("playwright.sync_api", "playwright"), ("jupyterlab", "jupyterlab"),
                            ("notebook.app", "notebook>=7"), ("jupyterlab_widgets", "ipywidgets")):
        try:
            __import__(module)
        except ImportError:
            return f"{package} is not installed"
    return None


def require_browser() -> None:
    """Skip the calling test when the browser stack is missing; under CI=true, fail instead."""
    why = missing()
    if why is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser test cannot run under CI=true: {why}; {HOW_TO_ENABLE}")
    pytest.skip(f"{why}; {HOW_TO_ENABLE}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class JupyterServer:
    """A Jupyter server with one front end (``frontend``: a key of ``FRONTENDS``) serving ``root``, with its own
    config, token and port; ``stop()`` ends it and its kernels (its own session)."""

    def __init__(self, root: str, frontend: str = "lab", start_timeout: float = 60.0, env: dict | None = None):
        module, app, self.notebook_prefix = FRONTENDS[frontend]
        self.frontend = frontend
        self.root = root
        self.port = free_port()
        self.token = os.urandom(12).hex()
        state = os.path.join(root, ".jupyter-test")
        config = os.path.join(state, "config")
        os.makedirs(os.path.join(config, "labconfig"), exist_ok=True)
        with open(os.path.join(config, "labconfig", "page_config.json"), "w") as f:  # read by both front ends
            json.dump({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}, f)
        server_env = dict(os.environ, JUPYTER_CONFIG_DIR=config, JUPYTER_RUNTIME_DIR=os.path.join(state, "runtime"))
        server_env.update(env or {})
        self._log = open(os.path.join(state, f"{frontend}.log"), "wb")
        app_settings = [f"--{app}.user_settings_dir={os.path.join(state, 'settings')}",
                        f"--{app}.workspaces_dir={os.path.join(state, 'workspaces')}",
                        f"--{app}.expose_app_in_browser=True"]  # window.jupyterapp, for wait_idle
        if frontend == "lab":
            app_settings.append("--LabApp.news_url=None")  # Notebook 7 has no such setting
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, "--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1",
             f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
             f"--ServerApp.root_dir={root}", *app_settings],
            cwd=root, env=server_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                urllib.request.urlopen(self.url("api/status"), timeout=2).read()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{module} ({frontend}) did not start:\n{self.output()}")
                time.sleep(0.2)

    def notebook_url(self, path: str) -> str:
        """The URL that opens the notebook ``path`` (relative to the root) in this server's front end."""
        return self.url(self.notebook_prefix + path)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path}?token={self.token}"

    def output(self) -> str:
        """The end of the server's log (kernel errors land here)."""
        with open(self._log.name, "rb") as f:
            return f.read().decode(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()

    def __enter__(self) -> "JupyterServer":
        return self

    def __exit__(self, etype, value, tb) -> None:
        if etype is not None:
            print(self.output(), file=sys.stderr)
        self.stop()


class Browser:
    """Chromium with a fresh profile in ``profile_dir``; the context manager gives its page."""

    def __init__(self, profile_dir: str, width: int = 1400, height: int = 1000, timeout_ms: int = 30_000):
        self.profile_dir = profile_dir
        self.viewport = {"width": width, "height": height}
        self.timeout_ms = timeout_ms

    def __enter__(self):
        from playwright.sync_api import sync_playwright

        shutil.rmtree(self.profile_dir, ignore_errors=True)
        self._playwright = sync_playwright().start()
        try:
            self.context = self._playwright.chromium.launch_persistent_context(
                self.profile_dir, executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
                viewport=self.viewport)
        except BaseException:
            self._playwright.stop()
            raise
        page = self.context.pages[0] if self.context.pages else self.context.new_page()
        page.set_default_timeout(self.timeout_ms)
        return page

    def __exit__(self, etype, value, tb) -> None:
        try:
            self.context.close()
        finally:
            self._playwright.stop()


def wait_for_text(locator, pattern: str, timeout: float = 30.0) -> str:
    """Wait until the first element of ``locator`` has text matching ``pattern``; that text."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if locator.count():
            last = locator.first.inner_text()
            if re.search(pattern, last):
                return last
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} did not appear within {timeout:.0f} s; last text: {last!r}")


# The state of the current notebook as its page sees it: its kernel connection (the one the status bar or Notebook 7's
# kernel indicator shows) and how many code cells wait or run (prompt ``[*]``: set when a cell is sent to the kernel,
# before the kernel says busy, and cleared when its reply arrives).
NOTEBOOK_STATE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const session = panel && panel.sessionContext;
  const kernel = session && session.session && session.session.kernel;
  const pending = [...document.querySelectorAll('.jp-Notebook .jp-Cell .jp-InputPrompt')]
    .filter((prompt) => prompt.textContent.includes('*')).length;
  return {ready: Boolean(session && session.isReady), kernel: kernel ? kernel.status : null,
          connection: kernel ? kernel.connectionStatus : null, pending};
}"""


def wait_idle(page, timeout: float = 120.0) -> None:
    """Wait until the page's kernel is connected and idle and no cell waits or runs (twice in a row, 0.2 s apart).

    Counting cells with prompt ``[*]`` covers the moment after "run all" when the kernel still reports idle
    because it has not yet said it is busy."""
    deadline = time.monotonic() + timeout
    state, idle_checks = None, 0
    while time.monotonic() < deadline:
        state = page.evaluate(NOTEBOOK_STATE)
        idle = state == {"ready": True, "kernel": "idle", "connection": "connected", "pending": 0}
        idle_checks = idle_checks + 1 if idle else 0
        if idle_checks >= 2:
            return
        time.sleep(0.2)
    raise AssertionError(f"the notebook's kernel was not idle within {timeout:.0f} s; last state: {state}")


def write_notebook(path, sources: list[str]) -> None:
    """Write a notebook of code cells ``sources`` to ``path``, for the python3 kernel."""
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def open_notebook(page, server: JupyterServer, path: str, timeout: float = 60.0) -> None:
    """Open ``path`` (relative to the server's root) in the server's front end and wait for its kernel."""
    page.goto(server.notebook_url(path))
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    wait_idle(page, timeout)


def run_all_cells(page) -> None:
    """Run > Run All Cells, from the menu bar (the same menu and command in both front ends)."""
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(r"^Run$")).click()
    page.locator("li.lm-Menu-item[data-command='runmenu:run-all']").click()


@contextlib.contextmanager
def notebook_run_in_browser(tmp_path, frontend: str, name: str, sources: list[str]):
    """A notebook ``name`` of code cells ``sources`` in a fresh folder under ``tmp_path``, served by ``frontend``,
    opened in Chromium and every cell run (Run All); yields the page."""
    require_browser()
    root = tmp_path / "root"
    root.mkdir()
    write_notebook(str(root / name), sources)
    with JupyterServer(str(root), frontend) as server, Browser(str(tmp_path / "profile")) as page:
        open_notebook(page, server, name)
        run_all_cells(page)
        yield page


def cells(page):
    """The notebook's cells, in order (``.nth(i)``)."""
    return page.locator(".jp-Notebook .jp-Cell")


def screenshot(target, name: str) -> str:
    """Save a screenshot of a page (all of it) or of one element (a locator) as artifacts/<name>; its path."""
    os.makedirs(ARTIFACTS, exist_ok=True)
    path = os.path.join(ARTIFACTS, name)
    if hasattr(target, "goto"):
        target.screenshot(path=path, full_page=True)
    else:
        target.screenshot(path=path)
    return path
