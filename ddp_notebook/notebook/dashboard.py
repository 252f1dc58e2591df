"""Live metrics in the notebook: draw what the ranks report.

:func:`install` registers :func:`watch` as a job observer of the launcher; from
then on every job gets a :class:`Watcher` listening to its events and subscribed
to its metrics (the job's own: ``engine/metrics.py`` reduces the reports into
``job.history`` and forwards them to callbacks, with or without a view).
Nothing is shown and nothing heavy is imported until a rank reports.
Then, in a Jupyter kernel, a dashboard appears under the cell (:class:`DisplayView`):
a text status with a progress bar and matplotlib panels rendered to ``image/png``,
plain display outputs updated in place, so any front end shows them live with no
widget manager, redraws never pile up outputs, rank prints stay visible below, and
a saved notebook keeps the last figure.  Elsewhere (terminal, script, demo CLI)
each epoch prints one compact line.
"""
from __future__ import annotations

import base64
import io
import math
import os
import sys
import threading
import time
import warnings
from typing import Any

from ..wire import protocol
from ..engine import job as engine_job
from ..engine.history import Reducer
from ..engine.output import release_kernel_pipe
from ..wire.protocol import META_KEYS, TOTAL_KEYS, format_record

STATUS_EVERY_S = 0.5  # the status line and the figure are looked at this often
MIN_REDRAW_S = 0.5  # two figure redraws a second at most
# Drawing's budget (DrawBudget): the kernel spends at most this share of a core drawing, on average.  A figure of
# few updates (FEW_UPDATES: an epoch-wise run) is redrawn at each change, paced by MIN_REDRAW_S alone.
DRAW_SHARE = 0.003
DRAW_BURST_S = 0.1
FEW_UPDATES = 200  # until the curves have had this many updates (an epoch-wise run's), each change is drawn
MAX_STALE_S = 10.0  # but a figure that changed is drawn at least this often, whatever a redraw costs
STEP_LINE_EVERY_S = 2.0  # text view: step-wise reports print at most this often
MAX_PLOTTED_POINTS = 1000  # per curve; longer curves are thinned for drawing (history keeps all)


class DrawBudget:
    """How much the live figure may draw: ``share`` of a core on average, ``burst_s`` of it at once.

    A redraw (3-10 ms where the curves stay inside the live limits and only they
    are drawn; 30-200 ms of matplotlib's CPU, mostly ticks and labels, where the
    whole figure is) is charged after it is drawn, in the drawing thread's CPU
    time (not the wall time a busy machine stretches it to), to a credit that
    grows by ``share`` of the time passed, up to ``burst_s``.  A redraw may start
    while the credit is above zero: the first figures and a figure after a
    quiet spell (a new epoch) come at once, a run that changes its curves at
    every tick (``report()`` every step) redraws every second or two, and a
    redraw dearer than the whole burst only puts the next one off until it is
    paid for (down to ``-burst_s``: what a single redraw costs beyond that is
    forgiven, MAX_STALE_S draws a figure that changed anyway).
    """

    def __init__(self, now: float, share: float | None = None, burst_s: float | None = None):
        self.share = DRAW_SHARE if share is None else share  # (read now: a benchmark may set the module's)
        self.burst_s = DRAW_BURST_S if burst_s is None else burst_s
        self.credit = self.burst_s  # seconds of drawing that may be spent now
        self._credited_at = now

    def allows(self, now: float) -> bool:
        """Whether a redraw may start at ``now`` (a monotonic time): the credit grown since, above zero."""
        self.credit = min(self.burst_s, self.credit + (now - self._credited_at) * self.share)
        self._credited_at = now
        return self.credit > 0

    def charge(self, spent_s: float) -> None:
        """A redraw took ``spent_s`` of the drawing thread's CPU time."""
        self.credit = max(-self.burst_s, self.credit - spent_s)


def install() -> None:
    """Watch every job the launcher starts from now on (idempotent)."""
    from .cell_output import show_rank_displays

    engine_job.observe_jobs(watch)
    engine_job.observe_jobs(show_rank_displays)
    engine_job.set_viewer(show)


def watch(job) -> None:
    """The job observer: a watcher of the job's events and metrics."""
    job.add_listener(Watcher(job))


def kernel_frontend() -> bool:
    """True inside a Jupyter kernel (its front end shows display outputs), False in a terminal or script."""
    from .cell_output import kernel_shell

    return kernel_shell() is not None


def show(job) -> None:
    """Draw the job's dashboard again from its history: live if the job still runs, else static."""
    watcher = next((item for item in job.listeners if isinstance(item, Watcher)), None)
    history = getattr(job, "history", [])
    status = watcher.status if watcher is not None else Status.of_finished(job)
    reducer = watcher.reducer if watcher is not None else getattr(getattr(job, "metrics", None), "reducer", None)
    if not kernel_frontend():
        for record in history:
            print(format_record(record))
        print(status.line(reducer, time.time()) if history else "ddp_notebook: this job reported no metrics")
        return
    if watcher is not None and not job.done:
        watcher.add_view(DisplayView(watcher))
        return
    from IPython.display import display

    if not history:
        print("ddp_notebook: this job reported no metrics")
        return
    curves = Curves()
    for record in history:
        curves.add(record)
    summary = status.line(reducer, time.time())
    png = Plot().render(curves.snapshot(), title=summary, compress_level=6)
    display({"image/png": base64.b64encode(png).decode(), "text/plain": summary}, raw=True)


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _amount(value: float) -> str:
    """A count as people write it: 1000000 (not 1e+06), 2.5."""
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


class Status:
    """Ranks alive, elapsed time, where the x axis stands and the ETA."""

    def __init__(self, world_size: int, started_at: float):
        self.world_size = world_size
        self.started_at = started_at
        self.ready: set[int] = set()
        self.exited: set[int] = set()
        self.training_since: float | None = None  # every rank has joined the process group
        self.progress: dict[int, tuple[int, int]] = {}  # rank -> (done, total) in its current epoch
        self.outcome: str | None = None  # "done", "failed", "stopped"
        self.ended_at: float | None = None
        self.stopping: str | None = None  # a graceful stop under way
        self.returned: set[int] = set()  # ranks that sent their result (their process may end before the job)
        self.restart: str | None = None  # the latest restart: "rank 1 died (SIGKILL) at epoch 3 — attempt 2 of 3"
        self.saving: str | None = None  # the latest checkpoint saved in the background: "saving last.pt (blocked 0.12 s)"
        self.queued: str | None = None  # "Slurm job 1234 (Resources)" while a scheduler holds the job
        self.queued_since: float | None = None

    def scheduled(self, body: dict) -> None:
        """A scheduler's news of the job (``SCHEDULER`` events): queued until it runs; the clock starts then."""
        if body["state"] == "PENDING":
            self.queued = f"{body['scheduler']} job {body['job']}" + (f" ({body['reason']})" if body["reason"] else "")
            self.queued_since = body.get("since") or time.time()
        elif self.queued is not None:
            self.queued = None
            self.started_at = time.time()

    @classmethod
    def of_finished(cls, job) -> "Status":
        status = cls(job.spec.world_size, job.started_at or time.time())
        status.ended_at = job.ended_at
        status.outcome = "done" if job.status == "done" else "ended"
        return status

    def epoch_fraction(self) -> float | None:
        """The mean share of the current epoch done over the ranks, or None without progress reports."""
        if not self.progress:
            return None
        return sum(min(done / total, 1.0) if total else 0.0 for done, total in self.progress.values()) / \
            self.world_size

    @staticmethod
    def primary_key(reducer: Reducer | None) -> str | None:
        if reducer is None:
            return None
        for key in ("epoch", "step"):
            if reducer.counts.get(key) or key in reducer.totals:
                return key
        return None

    def eta(self, reducer: Reducer | None, now: float) -> float | None:
        key = self.primary_key(reducer)
        total = reducer.totals.get(key) if key else None
        if not total:
            return None
        units = reducer.done(key)
        if units >= total:
            return None
        if key == "epoch":
            # The unfinished part of the epoch under way; a rank at the end of its epoch counts 0 until
            # that epoch's record is complete, so the finished epoch is not counted twice.
            units += sum(done / total_batches for done, total_batches in self.progress.values()
                         if total_batches and done < total_batches) / self.world_size
        if units <= 0:
            return None
        since = self.training_since or self.started_at
        return max(0.0, (now - since) / units * (total - units))

    def line(self, reducer: Reducer | None, now: float) -> str:
        key = self.primary_key(reducer)
        where = ""
        if key:
            total = reducer.totals.get(key)
            where = f"{key} {_amount(reducer.done(key))}" + (f"/{total}" if total else "")
        if self.outcome is not None:
            end = self.ended_at or now
            parts = [self.outcome, f"{self.world_size} ranks"] + ([where] if where else []) + \
                [_clock(end - self.started_at)] + ([self.restart] if self.restart else [])
            return " · ".join(parts)
        if self.queued is not None:
            return f"queued: {self.queued}, {_clock(now - self.queued_since)}"
        stopped = self.stopping is not None and len(self.returned) == self.world_size
        if stopped:  # every rank stopped at the boundary and returned; their processes may be gone already
            parts = [f"{self.world_size}/{self.world_size} ranks stopped, ending"]
        elif len(self.ready) < self.world_size and not self.exited:
            parts = [f"starting: {len(self.ready)}/{self.world_size} ranks ready"]
        else:
            # A rank that returned and ended is done, not dead: alive counts those still running or done.
            gone = len(self.exited - self.returned)
            parts = [f"{self.world_size - gone}/{self.world_size} ranks alive"]
        if where:
            parts.append(where)
        parts.append(f"{_clock(now - self.started_at)} elapsed")
        eta = self.eta(reducer, now)
        if eta is not None:
            parts.append(f"ETA {_clock(eta)}")
        if self.restart:
            parts.append(self.restart)
        if self.stopping and not stopped:
            parts.append(self.stopping)
        if self.saving:
            parts.append(self.saving)
        return " · ".join(parts)


def saving_text(body: dict) -> str:
    """A checkpoint being written in the background, written or failed, and how long the training waited for it."""
    name = os.path.basename(body["path"])
    blocked = f"training blocked {body['blocked_s']:.2f} s"
    if body.get("error"):
        return f"background save of {name} failed ({blocked})"
    if body.get("written_s") is None:
        return f"saving {name} in the background ({blocked})"
    return f"{name} saved in the background ({blocked}, written in {body['written_s']:.1f} s)"


class Series:
    """One curve's points for drawing, bounded however long the run: up to ``2 * MAX_PLOTTED_POINTS``; past that,
    every other one is let go and from then on only every ``stride``-th point is kept (the history keeps them
    all), and the latest point is always drawn."""

    __slots__ = ("xs", "ys", "stride", "seen", "tip")

    def __init__(self):
        self.xs: list = []
        self.ys: list = []
        self.stride = 1
        self.seen = 0  # points added (kept or not) since the first one kept
        self.tip: tuple | None = None  # the latest point, where it was not kept

    def add(self, x, y) -> None:
        if self.tip is not None and self.tip[0] >= x:
            self.tip = None
        xs, ys = self.xs, self.ys
        if xs and xs[-1] >= x:  # a restarted attempt replays these x values: its points replace them
            while xs and xs[-1] >= x:
                xs.pop()
                ys.pop()
            self.seen = len(xs) * self.stride
        if self.seen % self.stride:
            self.tip = (x, y)
        else:
            xs.append(x)
            ys.append(y)
            self.tip = None
            if len(xs) > 2 * MAX_PLOTTED_POINTS:
                del xs[1::2], ys[1::2]
                self.stride *= 2
        self.seen += 1

    def lists(self) -> tuple[list, list]:
        """Copies of the points to draw."""
        if self.tip is None:
            return list(self.xs), list(self.ys)
        return self.xs + [self.tip[0]], self.ys + [self.tip[1]]


class Curves:
    """The points to plot, by (x key, metric name), fed with the reducer's updates (bounded: :class:`Series`)."""

    def __init__(self):
        self.points: dict[tuple[str, str], Series] = {}
        self.partial: dict[tuple[str, str], Series] = {}
        self.restarts: list[tuple[str, float]] = []  # (x key, x) where an attempt failed and the job restarted
        self.reporters: dict[str, list[int]] = {}  # metrics only some ranks report: their ranks (history's)
        self.totals: dict[str, float] = {}  # x key -> the x the run ends at, where the ranks said it (the reducer's)
        self.version = 0

    def mark_restart(self, key: str, x: float) -> None:
        self.restarts.append((key, x))
        self.version += 1

    def add(self, update: dict) -> None:
        key = "step" if "step" in update else "epoch"
        if key not in update:
            return
        x = update[key]
        partial = set(update["partial"].split(",")) if update.get("partial") else ()
        for name, value in update.items():
            if name in META_KEYS:
                continue
            series = self.points.get((key, name))
            if series is None:
                series = self.points[(key, name)] = Series()
            series.add(x, value)
            if name in partial:
                series = self.partial.get((key, name))
                if series is None:
                    series = self.partial[(key, name)] = Series()
                series.add(x, value)
        self.version += 1

    def snapshot(self) -> dict:
        """Copies, so a drawing thread can use them while new points arrive."""
        return {
            "points": {k: series.lists() for k, series in self.points.items()},
            "partial": {k: series.lists() for k, series in self.partial.items()},
            "restarts": list(self.restarts),
            "reporters": {name: tuple(ranks) for name, ranks in self.reporters.items()},
            "totals": dict(self.totals),
        }


def label(name: str, reporters: dict) -> str:
    """A metric's name as the dashboard shows it: ``loss (rank 0)`` where only rank 0 reports it."""
    ranks = reporters.get(name)
    if not ranks:
        return name
    return f"{name} (rank {ranks[0]})" if len(ranks) == 1 else f"{name} (ranks {', '.join(map(str, ranks))})"


def _group(name: str) -> str:
    low = name.lower()
    if "loss" in low:
        return "loss"
    if "acc" in low:
        return "accuracy"
    return name


def _thin(xs: list, ys: list) -> tuple[list, list]:
    if len(xs) <= MAX_PLOTTED_POINTS:
        return xs, ys
    stride = math.ceil(len(xs) / MAX_PLOTTED_POINTS)
    return xs[::stride] + xs[-1:], ys[::stride] + ys[-1:]


class Plot:
    """The matplotlib figure (Agg, no pyplot): losses together, accuracies together, others by name.

    A live figure (no title) is drawn in two layers: the axes, ticks, labels and legends once, kept as a bitmap,
    and the curves over it.  While every curve stays inside its axes' limits, a new frame only restores the
    bitmap and draws the curves (a few ms, where a whole figure takes 30 ms and more of matplotlib's text
    layout); the live limits leave room ahead (to the run's end where the ranks gave it, ``steps=``/``epochs=``,
    else as far again) and around the curves (half their range on each side, but never past zero where the
    curves do not cross it: a falling loss stays inside until it ends) so that holds most of the time.  The final
    figure is drawn whole, its limits fitted to the data.
    """

    PANEL_W, PANEL_H, DPI = 3.4, 2.4, 100
    AHEAD = 1.0  # live limits: this share of the curve's x range left free ahead of it (where no total was given)
    HEADROOM = 0.5  # and this share of its y range above and below it

    def __init__(self):
        self._figure = None
        self._layout = None
        self._lines: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._axes: list[tuple[Any, str]] = []  # (axes, x key)
        self._markers: list[Any] = []  # the restart lines drawn
        self._background = None  # the live figure without its curves, while its limits hold
        self._background_of = None  # (restarts, markers shown) the background was drawn with
        self.blitted = 0  # frames drawn over the kept background (for tests and benchmarks)

    @property
    def built(self) -> bool:
        """Whether the figure exists (its first drawing imports matplotlib and builds it)."""
        return self._figure is not None

    def render(self, snapshot: dict, title: str | None = None, compress_level: int = 1) -> bytes | None:
        """The figure as PNG bytes, or None when there is nothing to draw."""
        points = snapshot["points"]
        if not points:
            return None
        panels: dict[tuple[str, str], list[str]] = {}
        for key, name in points:
            panels.setdefault((_group(name), key), []).append(name)
        order = sorted(panels, key=lambda p: {"loss": 0, "accuracy": 1}.get(p[0], 2))
        reporters = snapshot.get("reporters", {})
        layout = (tuple((p, tuple(panels[p])) for p in order), title is not None, tuple(sorted(reporters.items())))
        if layout != self._layout:
            self._build(order, panels, title is not None, reporters)
            self._layout = layout
            self.forget_limits()
        live = title is None
        if not live:
            self._figure.suptitle(title, fontsize=10)
        markers_shown = []
        for ident, (line, partial_line) in self._lines.items():
            xs, ys = _thin(*points[ident])
            line.set_data(xs, ys)
            marked = len(xs) <= 40
            markers_shown.append(marked)
            line.set_marker("o" if marked else "")
            pxs, pys = snapshot["partial"].get(ident, ([], []))
            partial_line.set_data(pxs, pys)
        restarts = tuple(snapshot.get("restarts", ()))
        drawn_with = (restarts, tuple(markers_shown))
        canvas = self._figure.canvas
        if live and self._background is not None and drawn_with == self._background_of and self._curves_fit():
            canvas.restore_region(self._background)
            self._draw_curves()
            self.blitted += 1
        else:
            for marker in self._markers:
                marker.remove()
            self._markers = [ax.axvline(x, color="tab:red", linestyle=":", linewidth=1)
                             for ax, key in self._axes for restart_key, x in restarts if restart_key == key]
            for ax, key in self._axes:
                ax.relim()
                ax.autoscale_view()
                if live:
                    self._leave_room(ax, snapshot.get("totals", {}).get(key))
            for line, partial_line in self._lines.values():
                line.set_animated(live)
                partial_line.set_animated(live)
            canvas.draw()  # (savefig would draw the same, with a quarter more of bookkeeping around it)
            if live:
                self._background = canvas.copy_from_bbox(self._figure.bbox)
                self._background_of = drawn_with
                self._draw_curves()
            else:
                self._background = None
        from PIL import Image  # (matplotlib's own dependency, imported with it)

        width, height = canvas.get_width_height()
        image = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format="png", compress_level=compress_level)
        return buffer.getvalue()

    def forget_limits(self) -> None:
        """The next frame is drawn whole, its limits fitted to its curves (a new job's, on a figure kept)."""
        self._background = None

    def _draw_curves(self) -> None:
        for ax, _ in self._axes:
            for line in ax.get_lines():
                if line.get_animated():
                    ax.draw_artist(line)

    def _curves_fit(self) -> bool:
        """Whether every curve lies inside its axes' present limits."""
        import numpy

        for ax, _ in self._axes:
            (x_low, x_high), (y_low, y_high) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
            for line in ax.get_lines():
                if not line.get_animated():
                    continue
                xs = numpy.asarray(line.get_xdata(), dtype=float)
                ys = numpy.asarray(line.get_ydata(), dtype=float)
                shown = numpy.isfinite(xs) & numpy.isfinite(ys)
                if not shown.any():
                    continue
                xs, ys = xs[shown], ys[shown]
                if xs.min() < x_low or xs.max() > x_high or ys.min() < y_low or ys.max() > y_high:
                    return False
        return True

    def _leave_room(self, ax, total) -> None:
        """Live limits: room ahead on x (to the run's end where known) and around the curve on y."""
        x_low, x_high = ax.get_xlim()
        if x_high > x_low:
            ahead = x_high + (x_high - x_low) * self.AHEAD
            if total is not None and x_high < total:
                ahead = total + (total - x_low) * ax.margins()[0]
            ax.set_xlim(x_low, ahead, auto=True)  # (the next autoscale fits the data again)
        y_low, y_high = ax.get_ylim()
        if y_high > y_low and ax.get_yscale() == "linear":
            room = (y_high - y_low) * self.HEADROOM
            data_low, data_high = ax.dataLim.intervaly
            low, high = y_low - room, y_high + room
            if data_low >= 0:  # (a loss, an accuracy, a rate: the room below stops at zero)
                low = max(low, min(y_low, 0.0))
            if data_high <= 0:
                high = min(high, max(y_high, 0.0))
            ax.set_ylim(low, high, auto=True)

    def _build(self, order: list, panels: dict, titled: bool, reporters: dict) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator

        columns = min(len(order), 3)
        rows = math.ceil(len(order) / columns)
        top = 0.55 if titled else 0.3
        width, height = self.PANEL_W * columns, self.PANEL_H * rows + top - 0.3
        figure = Figure(figsize=(width, height), dpi=self.DPI)
        FigureCanvasAgg(figure)
        figure.subplots_adjust(left=0.6 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                               top=1 - top / height, wspace=0.35, hspace=0.6)
        self._lines = {}
        self._axes, self._markers = [], []
        for index, (group, key) in enumerate(order):
            ax = figure.add_subplot(rows, columns, index + 1)
            self._axes.append((ax, key))
            names = panels[(group, key)]
            title = group  # one curve has no legend: its title says whose it is
            if len(names) == 1 and names[0] in reporters:
                title = label(names[0], reporters) if names[0] == group else f"{group}: {label(names[0], reporters)}"
            # Placed once, not recomputed from the tick labels at every redraw (a quarter of a redraw's time).
            ax.set_title(title, fontsize=10, y=1.0)
            ax.set_xlabel(key, fontsize=8)
            ax.xaxis.set_label_coords(0.5, -0.17)
            ax.tick_params(labelsize=8)
            ax.grid(True, alpha=0.3)
            if key == "epoch":
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            for name in panels[(group, key)]:
                # Above the axes' frame and ticks (zorder 2.5), as a live frame draws them over its background.
                (line,) = ax.plot([], [], label=label(name, reporters), linewidth=1.5, markersize=3, zorder=3)
                (partial_line,) = ax.plot([], [], linestyle="", marker="o", markersize=6, markerfacecolor="none",
                                          color=line.get_color(), zorder=3)
                self._lines[(key, name)] = (line, partial_line)
            if len(panels[(group, key)]) > 1:
                ax.legend(fontsize=8, loc="lower right" if group == "accuracy" else "upper right")
        self._figure = figure


_spare_plots: list[Plot] = []  # one live figure kept between jobs: building one costs 60 ms and more of the kernel


def _spare_plot() -> Plot:
    try:
        plot = _spare_plots.pop()
    except IndexError:
        return Plot()
    plot.forget_limits()
    return plot


def _keep_spare_plot(plot: Plot) -> None:
    if plot.built:
        _spare_plots[:] = [plot]


def _forget_fonts() -> None:
    """Let go of the fonts matplotlib opened for the dashboard's threads.

    matplotlib keeps the fonts it opens (and their fds) per thread id, up to 64
    threads: every dashboard's drawing thread would leave its own set open in the
    kernel long after it ended.  There is no public way to drop one thread's.
    """
    font_manager = sys.modules.get("matplotlib.font_manager")
    clear = getattr(getattr(font_manager, "_get_font", None), "cache_clear", None)
    if clear is not None:
        clear()


class TextView:
    """Outside a notebook: one compact line per epoch (step-wise reports: one every few seconds)."""

    def __init__(self, watcher: "Watcher", out=None):
        self.watcher = watcher
        self.out = out
        self._held: dict | None = None
        self._last_step_line = float("-inf")

    def updated(self, updates: list[dict]) -> None:
        now = time.monotonic()
        for update in updates:
            if "step" in update and not update.get("partial"):
                self._held = update
                if now - self._last_step_line >= STEP_LINE_EVERY_S:
                    self._print(self._held)
                    self._last_step_line = now
            else:
                self._print(update)

    def finish(self, updates: list[dict]) -> None:
        if self._held is not None:
            self._print(self._held)
        for update in updates:
            self._print(update)

    def _print(self, update: dict) -> None:
        if update is self._held:
            self._held = None
        watcher = self.watcher
        now = time.time()
        status = watcher.status
        suffix = f"({_clock(now - status.started_at)}"
        eta = status.eta(watcher.reducer, now)
        suffix += f", ETA {_clock(eta)})" if eta is not None and status.outcome is None else ")"
        record = dict(update)
        key = "step" if "step" in record else "epoch"
        total = watcher.reducer.totals.get(key)
        if total is not None:
            record[TOTAL_KEYS[key]] = total
        out = self.out or sys.stdout
        out.write(format_record(record, suffix) + "\n")
        out.flush()


class DisplayView:
    """The live dashboard under the cell, as plain display outputs updated in place.

    Two outputs with display ids (:class:`~.cell_output.CellOutput`): a ``text/plain``
    status (status line, a text progress bar, how to stop a background job) and the
    figure as ``image/png`` with its status line as ``text/plain``.  Every front end
    that shows outputs renders them, with no widget manager; updates replace them, so
    the outputs never grow and a saved notebook keeps the last figure.  A small thread
    updates them a few times a second, so the clock moves even while no event arrives;
    the events only record data.  A background job also gets a Stop button, the one
    widget (a control), whose plain equivalent the status names.
    """

    def __init__(self, watcher: "Watcher", stop=None, stop_hint: str | None = None):
        from .cell_output import CellOutput

        self.watcher = watcher
        self.stop_hint = stop_hint
        self.stop_button, self.stop_output = _stop_button(stop, stop_hint) if stop is not None else (None, None)
        self.status_output = CellOutput({"text/plain": "ddp_notebook: starting"})
        self.figure_output = CellOutput({"text/plain": ""})  # the figure takes this place once there is one
        self.plot = _spare_plot()
        self.updates_sent = 0
        self._drawn_version = -1
        self._next_draw = 0.0
        self._budget = DrawBudget(time.monotonic())
        self._png: str | None = None
        self._broken = False
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._tick, name="ddp-dashboard", daemon=True)
        self._thread.start()

    def updated(self, updates: list[dict]) -> None:
        """New data: the ticking thread draws it."""

    def _tick(self) -> None:
        try:
            while not self._stop.wait(STATUS_EVERY_S):
                try:
                    self.refresh()
                except Exception as exc:  # noqa: BLE001 - a drawing failure must not touch the job
                    if not self._broken:
                        self._broken = True
                        warnings.warn(f"ddp_notebook: the live dashboard stopped updating: {exc!r}", stacklevel=1)
                    return
        finally:
            release_kernel_pipe()  # the descriptor the kernel gave this thread for its updates, closed now

    def status_text(self, line: str, final: bool = False) -> str:
        """The status output: the status line, a progress bar while the job runs, how to stop it."""
        lines = [f"ddp_notebook · {line}"]
        watcher = self.watcher
        if not final:
            with watcher.lock:
                fraction = watcher.status.epoch_fraction()
                progress = dict(watcher.status.progress)
                key = Status.primary_key(watcher.reducer)
                total = watcher.reducer.totals.get(key) if key else None
                done = watcher.reducer.done(key) if key else 0
            if fraction is not None:
                batches = max(total_batches for _, total_batches in progress.values())
                lines.append(_text_bar(fraction, f"{round(fraction * batches)}/{batches} batches"))
            elif total:
                lines.append(_text_bar(min(done / total, 1.0), f"{_amount(done)}/{total} {TOTAL_KEYS[key]}"))
            if self.stop_hint:
                button = "the Stop button, or " if self.stop_button is not None else ""
                lines.append(f"stop it: {button}{self.stop_hint}")
        ranks = getattr(watcher.job, "ranks", None)
        if ranks:
            with watcher.lock:
                lines += ranks.lines()
        return "\n".join(lines)

    def refresh(self, final: bool = False) -> None:
        watcher = self.watcher
        with watcher.lock:
            line = watcher.status.line(watcher.reducer, time.time())
            version = watcher.curves.version
            snapshot = None
            now = time.monotonic()
            affordable = self._budget.allows(now)
            if final or (version != self._drawn_version and now >= self._next_draw
                         and (version <= FEW_UPDATES or affordable or now >= self._next_draw + MAX_STALE_S)):
                snapshot = watcher.curves.snapshot()
        status = self.status_text(line, final)
        if status != self.status_output.data["text/plain"]:
            self.status_output.update({"text/plain": status})
            self.updates_sent += 1
        if snapshot is None:
            return
        started = time.thread_time()
        first = not self.plot.built  # pays for importing matplotlib: no measure of drawing
        png = self.plot.render(snapshot, title=line if final else None, compress_level=6 if final else 1)
        if not first:
            self._budget.charge(time.thread_time() - started)
        self._next_draw = time.monotonic() + MIN_REDRAW_S
        self._drawn_version = version
        if png is not None:
            self.figure_output.update({"image/png": base64.b64encode(png).decode(), "text/plain": line})
            self.updates_sent += 1

    def finish(self, updates: list[dict]) -> None:
        """Stop ticking; leave the final status and the final figure, titled with the status line."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if self.stop_button is not None:  # nothing left to stop: the button leaves the page and the saved notebook
            self.stop_output.update({"text/plain": ""})
            # its layout and style are widgets too, kept by ipywidgets until closed (jupyter-widgets/ipywidgets#2308)
            for widget in (self.stop_button, self.stop_button.layout, self.stop_button.style):
                widget.close()
        live_plot, self.plot = self.plot, Plot()  # the final figure is drawn apart, with its title...
        self.refresh(final=True)
        _keep_spare_plot(live_plot)  # ...and the live one is kept for the next job's dashboard
        _forget_fonts()


def _text_bar(fraction: float, label: str, width: int = 30) -> str:
    filled = round(min(max(fraction, 0.0), 1.0) * width)
    return "[" + "#" * filled + "." * (width - filled) + "] " + label


def _stop_button(stop, stop_hint: str | None):
    """A background job's Stop button (ipywidgets) and its output; (None, None) without ipywidgets.

    Its ``text/plain`` (what a front end without a widget manager shows) says the plain way to stop.
    """
    try:
        import ipywidgets as widgets
    except ImportError:
        return None, None
    from .cell_output import CellOutput

    button = widgets.Button(description="Stop", button_style="danger", icon="stop")
    button.add_class("ddp-notebook-stop")
    button.on_click(lambda _: (setattr(button, "disabled", True), stop()))
    bundle = button._repr_mimebundle_()
    bundle["text/plain"] = f"[Stop button: needs a widget manager; {stop_hint or 'job.stop()'} does the same]"
    return button, CellOutput(bundle)


class Watcher:
    """Listens to one job for its status, subscribes to its metrics for the curves, keeps its views."""

    def __init__(self, job):
        self.job = job
        metrics = job.metrics
        self.reducer = metrics.reducer
        self.lock = metrics.lock  # one lock for the reducer and the curves, between the job and the drawing thread
        self.status = Status(job.spec.world_size, job.started_at or time.time())
        self.curves = Curves()
        self.views: list = []
        self.curves.reporters = metrics.history.reporters
        self.curves.totals = self.reducer.totals
        self._view_chosen = False
        self._started_on = threading.get_ident()
        self._warned = False
        if not metrics.subscribe(self):
            self.status.outcome = "ended"

    def __call__(self, job, kind: str, rank: int, body: dict) -> None:
        try:
            self._on_event(kind, rank, body)
        except Exception as exc:  # noqa: BLE001 - metrics must never break the job
            self._warn(kind, exc)

    def _warn(self, kind: str, exc: Exception) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"ddp_notebook: live metrics failed on a {kind!r} event: {exc!r}", stacklevel=1)

    def add_view(self, view) -> None:
        """Keep the view up to date; finish it at once if the job has already ended (it ticks until then)."""
        with self.lock:  # metrics_finished sets the outcome under it, then finishes the views it has
            ended = self.status.outcome is not None
            if not ended:
                self.views.append(view)
        if ended:
            view.finish([])

    # -- the job's metrics (engine/metrics.py), in the order they were made -----------------------------------
    def metrics_updated(self, updates: list[dict]) -> None:
        try:
            with self.lock:
                for update in updates:
                    self.curves.add(update)
            self._first_report()  # (at a job's first report, even one that waits for other ranks' reports)
            self._tell_views("updated", updates)
        except Exception as exc:  # noqa: BLE001
            self._warn(protocol.METRIC, exc)

    def metrics_restarted(self, reached: dict[str, float], attempt: int, attempts: int, cause: str) -> None:
        """An attempt failed and the job runs again on fresh ranks: mark it on the curves and the status line."""
        with self.lock:
            key = Status.primary_key(self.reducer)
            where = f" at {key} {reached[key]}" if key in reached else ""
            if key in reached:
                self.curves.mark_restart(key, reached[key] - 0.5)
            status = self.status
            status.restart = f"{cause}{where} — attempt {attempt + 1} of {attempts}"
            status.ready.clear()
            status.exited.clear()
            status.progress.clear()
        print(f"ddp_notebook: {status.restart}", file=sys.stderr)

    def metrics_finished(self, updates: list[dict]) -> None:
        job = self.job
        with self.lock:
            for update in updates:
                self.curves.add(update)
            self.status.ended_at = job.ended_at or time.time()
            stopped_text = getattr(job, "stopped_text", None)  # a Job's; a followed run has none
            if stopped_text:
                self.status.outcome = stopped_text
            elif job.status == "done":
                self.status.outcome = "done"
            elif job.status == "stopped":
                self.status.outcome = "stopped"
            else:
                self.status.outcome = "failed"
        self._tell_views("finish", updates)
        # Their last drawing is in the page; each view's figure and outputs would otherwise live as long as the
        # job does (a background job is the cell's value, Out[n]). show() draws again from the history.
        self.views = []

    # -- the job's events: its status -------------------------------------------------------------------------
    def _on_event(self, kind: str, rank: int, body: dict) -> None:
        if kind == protocol.PROGRESS:
            with self.lock:
                self.status.progress[rank] = (int(body["done"]), int(body["total"]))
            self._first_report()
        elif kind == protocol.READY:
            self.status.ready.add(rank)
            if len(self.status.ready) == self.status.world_size:
                self.status.training_since = time.time()
        elif kind == protocol.EXITED:
            self.status.exited.add(rank)
        elif kind == protocol.SCHEDULER:
            with self.lock:
                self.status.scheduled(body)
            if self.status.queued is not None:
                self._first_report()  # the dashboard shows while the job waits in the queue
        elif kind == protocol.RESULT:
            with self.lock:
                self.status.returned.add(rank)
        elif kind == protocol.STOPPING:
            with self.lock:
                self.status.stopping = f"stopping at the next batch (asked by {body['by']})"
        elif kind == protocol.SAVING:
            with self.lock:
                self.status.saving = saving_text(body)
        elif kind == protocol.RESUMED:
            with self.lock:
                self.status.restart = f"{self.status.restart}, resuming from epoch {body['epoch']}" \
                    if self.status.restart else f"resuming from epoch {body['epoch']}"
            print(f"ddp_notebook: attempt {getattr(self.job, 'attempt', 0) + 1} resumes from epoch "
                  f"{body['epoch']}", file=sys.stderr)

    def _first_report(self) -> None:
        """Choose the view at the first report, so a job that reports nothing shows nothing."""
        if self._view_chosen:
            return
        self._view_chosen = True
        if threading.get_ident() != self._started_on:
            return  # a job waited on in the background: its output would land in another cell; job.show()
        self.add_view(DisplayView(self) if kernel_frontend() else TextView(self))

    def _tell_views(self, method: str, updates: list[dict]) -> None:
        for view in list(self.views):
            try:
                getattr(view, method)(updates)
            except Exception as exc:  # noqa: BLE001
                self.views.remove(view)
                warnings.warn(f"ddp_notebook: the metrics view failed and was closed: {exc!r}", stacklevel=1)


def attach(job) -> None:
    """Show a background job's dashboard now, under the current cell, with a Stop button.

    Its events arrive on the job's own thread, where a first display would land
    in whatever cell runs then; so the view is made here, in the job's cell.
    """
    from .cell_output import kernel_shell

    watcher = next((listener for listener in job.listeners if isinstance(listener, Watcher)), None)
    shell = kernel_shell()
    if watcher is None or shell is None:
        return
    watcher._view_chosen = True
    # The magic returns the job as the cell's value: Out[n], also known as _n.
    hint = f"_{shell.displayhook.prompt_count}.stop()"
    watcher.add_view(DisplayView(watcher, stop=lambda: job.stop(by="the dashboard's Stop button"), stop_hint=hint))
