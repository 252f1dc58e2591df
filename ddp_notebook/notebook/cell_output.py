"""Display outputs that stay under the cell that made them, updated in place from any thread.

Plain Jupyter display data with a display id: every front end that shows outputs
(JupyterLab, Notebook 7, VS Code, Colab, Kaggle, a console) renders it, with no
widget manager.  The cell's parent header is captured when the output is made, in
the cell's own thread, and every later message carries it: a dashboard thread or a
background job's thread updates the right output on ipykernel 6 and 7 alike (which
differ in how a thread's output finds its cell), while other cells run.
"""
from __future__ import annotations

import collections
import sys
import threading
import uuid

from ..engine import output
from ..wire import protocol


def kernel_shell():
    """The running IPython shell if it is a Jupyter kernel's (it publishes display data), else None."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    return shell


class Cell:
    """The cell that runs now, remembered: :meth:`send` publishes under it later, from any thread."""

    def __init__(self):
        shell = kernel_shell()
        if shell is None:
            raise RuntimeError("ddp_notebook: cell outputs need a Jupyter kernel")
        self._publisher = shell.display_pub
        self.parent = dict(self._publisher.parent_header)

    def send(self, kind: str, data: dict[str, str], metadata: dict | None = None,
             display_id: str | None = None) -> None:
        """Publish ``display_data`` or ``update_display_data`` under this cell."""
        publisher = self._publisher
        for stream in (sys.stdout, sys.stderr):  # what the cell printed before comes first
            stream.flush()
        content = {"data": data, "metadata": metadata or {}, "transient": {}}
        if display_id is not None:
            content["transient"]["display_id"] = display_id
        publisher.session.send(publisher.pub_socket, kind, content, parent=self.parent, ident=publisher.topic)


class CellOutput:
    """One output under the current cell; :meth:`update` replaces its content, from any thread."""

    def __init__(self, data: dict[str, str]):
        self.cell = Cell()
        self.display_id = f"ddp-{uuid.uuid4().hex}"
        self.data = dict(data)
        self.cell.send("display_data", self.data, display_id=self.display_id)

    def update(self, data: dict[str, str]) -> None:
        """Replace what the output shows (``update_display_data``): the output does not grow."""
        self.data = dict(data)
        self.cell.send("update_display_data", self.data, display_id=self.display_id)


class CellLog:
    """Text written from any thread into one output under the cell that made it, updated in place.

    Keeps the newest ``max_lines`` lines (and says how many earlier ones left), so
    the output stays bounded however long a background job prints.  A line not
    ended yet shows as written so far, and one redrawn after ``\\r`` (a progress
    bar) as its newest drawing, as in a terminal.
    """

    def __init__(self, max_lines: int = 200):
        self._lines: collections.deque[str] = collections.deque(maxlen=max_lines)
        self._dropped = 0
        self._unended = ""
        self._lock = threading.Lock()
        self._output = CellOutput({"text/plain": ""})

    def write(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            *lines, unended = (self._unended + text).split("\n")
            self._unended = output.unended_line(unended)
            for line in lines:
                if len(self._lines) == self._lines.maxlen:
                    self._dropped += 1
                self._lines.append(output.shown_line(line))
            shown = "\n".join([*self._lines, output.shown_line(self._unended)] if self._unended else self._lines)
            if self._dropped:
                shown = f"[ddp_notebook] ... {self._dropped} earlier lines not shown ...\n" + shown
            self._output.update({"text/plain": shown})

    def flush(self) -> None:
        """Every write is shown at once."""


def show_rank_displays(job) -> None:
    """The job observer for rich output: what a rank's ``display()``/``plt.show()`` sends shows in the job's cell.

    Each display is announced by a ``[rank r] shows ...`` line through the job's output relay (so it is
    labelled like the rank's prints and ``--output`` holds for it), then published under the cell that
    started the job, whichever thread receives it.  Outside a kernel only the line is printed.
    """
    cell = Cell() if kernel_shell() is not None else None

    def listener(job, kind: str, rank: int, body: dict) -> None:
        if kind != protocol.DISPLAY:
            return
        relay = job.relay
        if relay.ranks is not None and rank not in relay.ranks:
            return
        data = body["data"]
        relay.feed(rank, "stdout", f"shows {data.get('text/plain', 'a display')}\n".encode())
        relay.flush()
        if cell is not None:
            cell.send("display_data", data, {**body.get("metadata", {}), "ddp_notebook": {"rank": rank}})

    job.add_listener(listener)
