"""The GPU picker: an ipywidgets panel whose choice becomes the default devices.

``ddp_notebook.gpu_picker()`` (or ``%ddp_gpus``) lists the GPUs with their
load and who runs on them, lets the user tick which to use and shows how many
ranks that means.  Every later ``%%ddp`` cell and ``launch()`` that names no
devices uses the ticked GPUs; ``--gpus``/``--cpus`` still win, and so does a
warm pool.  Without GPUs it says so and offers a number of CPU ranks instead.

Notebook side only: ranks never import this module.
"""
from __future__ import annotations

import html
import os
import time
from typing import Any, Callable

import ipywidgets as widgets

from ..engine import devices as gpu_discovery
from ..engine import reservations
from ..engine import spec as job_spec
from ..wire.errors import LaunchError

_active: "GPUPicker | None" = None

_BAR = ("<div style='display:inline-block;width:120px;height:10px;background:#e0e0e0;border-radius:3px;"
        "vertical-align:middle;margin-right:6px'><div style='width:{pct:.0f}%;height:100%;background:{color};"
        "border-radius:3px'></div></div>")


def _bar(fraction: float, load: float) -> str:
    """A memory bar coloured by load: green, amber from 50 %, red from 85 %."""
    fraction = min(max(fraction, 0.0), 1.0)
    color = "#2e7d32" if load < 0.5 else ("#f9a825" if load < 0.85 else "#c62828")
    return _BAR.format(pct=fraction * 100, color=color)


class GPUPicker(widgets.VBox):
    """The panel; ``selection`` is what cells that name no devices get."""

    def __init__(self, discover: Callable[[], tuple[list, str]] | None = None, cpu_ranks: int | None = None,
                 selected: list[int] | None = None):
        self._discover = discover or gpu_discovery.discover_report
        self.gpus: list[gpu_discovery.GPU] = []
        self.source = ""
        self.checkboxes: dict[int, widgets.Checkbox] = {}
        self.header = widgets.HTML()
        self.rows = widgets.VBox()
        self.cpu_ranks = widgets.BoundedIntText(
            value=cpu_ranks or job_spec.DEFAULT_CPU_RANKS, min=1, max=max(8, 4 * (os.cpu_count() or 1)),
            description="CPU ranks", style={"description_width": "initial"}, layout=widgets.Layout(width="170px"))
        self.cpu_ranks.observe(self._changed, "value")
        self.refresh_button = widgets.Button(description="Refresh", icon="refresh", tooltip="read the GPUs again",
                                             layout=widgets.Layout(width="110px"))
        self.refresh_button.on_click(lambda _button: self.refresh())
        self.summary = widgets.HTML()
        super().__init__([self.header, self.rows, widgets.HBox([self.refresh_button, self.summary])])
        self.add_class("ddp-gpu-picker")
        self._wanted = None if selected is None else set(selected)
        self.refresh()

    # -- readings --------------------------------------------------------
    def refresh(self) -> None:
        """Read the GPUs again; ticks stay on the GPUs that are still there."""
        if self.checkboxes:
            self._wanted = {i for i, box in self.checkboxes.items() if box.value}
        self.gpus, self.source = self._discover()
        stamp = time.strftime("%H:%M:%S")
        if not self.gpus:
            self.header.value = (f"<b>No GPU on this machine</b> ({html.escape(self.source)}; read at {stamp}).<br>"
                                 "<code>%%ddp</code> cells will run CPU ranks with the gloo backend: how many?")
            self.checkboxes = {}
            self.rows.children = [self.cpu_ranks]
        else:
            self.header.value = (f"<b>GPUs</b> ({html.escape(self.source)}; read at {stamp}). Tick the GPUs that "
                                 "<code>%%ddp</code> cells without <code>--gpus</code>/<code>--cpus</code> use:")
            try:
                held = reservations.holders([g.lock_name for g in self.gpus])
            except LaunchError as refused:  # (the folder of reservations is not trusted): the panel says why
                held = dict.fromkeys(g.lock_name for g in self.gpus)
                self.header.value += (f"<br><span class='ddp-picker-refused' style='color:#c62828'>"
                                      f"{html.escape(str(refused))}</span>")
            wanted = self._wanted if self._wanted is not None else \
                {g.index for g in self.gpus if not g.busy and held[g.lock_name] is None}
            self.checkboxes = {}
            rows = []
            for gpu in self.gpus:
                box = widgets.Checkbox(value=gpu.index in wanted, description=f"GPU {gpu.index}", indent=False,
                                       layout=widgets.Layout(width="80px"))
                box.add_class(f"ddp-gpu-{gpu.index}")
                box.observe(self._changed, "value")
                self.checkboxes[gpu.index] = box
                rows.append(widgets.HBox([box, widgets.HTML(self._row_html(gpu, held[gpu.lock_name]))]))
            self.rows.children = rows
        self._changed()

    @staticmethod
    def _row_html(gpu: gpu_discovery.GPU, holder: reservations.Holder | None = None) -> str:
        fraction = gpu.memory_used / gpu.memory_total if gpu.memory_total else 0.0
        load = max(fraction, gpu.utilization / 100)  # the bar is memory; its colour is the worse of both
        jobs = html.escape(gpu.jobs_text())
        if holder is not None:
            jobs = f"<span style='color:#c62828;font-weight:bold'>reserved by {html.escape(holder.describe())}</span>; " \
                f"{jobs}"
        elif gpu.our_ranks:
            jobs = f"<span style='color:#c62828;font-weight:bold'>{jobs}</span>"
        elif gpu.processes:
            jobs = f"<span style='color:#8d6e00'>{jobs}</span>"
        else:
            jobs = f"<span style='color:#2e7d32'>{jobs}</span>"
        return (f"<span style='display:inline-block;width:190px'>{html.escape(gpu.name)}</span>"
                f"{_bar(fraction, load)}<span style='display:inline-block;width:150px'>"
                f"{html.escape(gpu.load_text())}</span>{jobs}")

    def _repr_mimebundle_(self, **kwargs):
        """The widget, and for front ends without a widget manager a text that says the plain way."""
        bundle = super()._repr_mimebundle_(**kwargs)
        if self.gpus:
            listing = "; ".join(f"GPU {g.index} {g.name}: {g.load_text()}, {g.jobs_text()}" for g in self.gpus)
            plain = "%ddp_gpus 0,1 (the GPU indices to use) or %ddp_gpus off"
        else:
            listing, plain = "no GPU", "%ddp_gpus cpu 2 (the number of CPU ranks) or %ddp_gpus off"
        bundle["text/plain"] = f"[GPU picker: needs a widget manager ({listing}); instead: {plain}]"
        return bundle

    # -- the choice ------------------------------------------------------
    @property
    def selection(self) -> tuple[str, Any] | None:
        """``("gpus", [indices])``, ``("cpus", n)``, or None while no GPU is ticked."""
        if not self.gpus:
            return ("cpus", int(self.cpu_ranks.value))
        ticked = sorted(i for i, box in self.checkboxes.items() if box.value)
        return ("gpus", ticked) if ticked else None

    def _default(self) -> tuple[str, Any]:
        chosen = self.selection
        if chosen is None:
            raise LaunchError("the GPU picker has no GPU ticked: tick one, or name the devices with --gpus/--cpus")
        return chosen

    def _changed(self, _change=None) -> None:
        if _active is not self:
            return
        chosen = self.selection
        if chosen is None:
            text = "No GPU ticked: cells that name no devices will stop and say so."
        elif chosen[0] == "cpus":
            n = chosen[1]
            text = f"Cells that name no devices run <b>{n} CPU rank{'s' if n != 1 else ''}</b> (gloo)."
        else:
            ticked = chosen[1]
            shared = [g.index for g in self.gpus if g.index in ticked and g.our_ranks]
            text = (f"<b>{len(ticked)} rank{'s' if len(ticked) != 1 else ''}</b> on GPU "
                    f"{', '.join(map(str, ticked))} (nccl) for cells that name no devices.")
            if shared:
                text += f" GPU {', '.join(map(str, shared))} already run a ddp_notebook job."
        self.summary.value = f"<span class='ddp-picker-summary'>{text}</span>"

    def activate(self) -> "GPUPicker":
        """Make this panel's choice the default (the newest panel is in charge)."""
        global _active
        previous, _active = _active, self
        if previous is not None and previous is not self:
            previous.summary.value = "<i>A newer GPU picker is in charge.</i>"
        job_spec.set_default_devices(self._default)
        self._changed()
        return self

    def close(self) -> None:
        """Remove the panel; its choice stops being the default."""
        if _active is self:
            forget()
        super().close()


def gpu_picker() -> GPUPicker:
    """Show the GPUs, tick which ones ``%%ddp`` cells that name no devices use; returns the panel.

    Starts from the previous panel's choice, or else from the GPUs that are not
    busy.  Explicit ``--gpus``/``--cpus`` win over it; ``%ddp_gpus off`` forgets it.
    """
    previous = _active
    kwargs: dict[str, Any] = {}
    if previous is not None:
        kwargs["cpu_ranks"] = int(previous.cpu_ranks.value)
        chosen = previous.selection
        kwargs["selected"] = chosen[1] if chosen and chosen[0] == "gpus" else ([] if previous.gpus else None)
    return GPUPicker(**kwargs).activate()


def choose(text: str) -> str:
    """The picker's choice without widgets: ``"0,1"`` (GPU indices) or ``"cpus 3"``; says what it chose.

    ``%ddp_gpus 0,1`` calls it; an index this machine does not have is refused by name.
    """
    words = text.replace(",", " ").split()
    if len(words) == 2 and words[0] == "cpus" and words[1].isdigit() and int(words[1]) > 0:
        choice: tuple[str, Any] = ("cpus", int(words[1]))
    elif words and all(word.isdigit() for word in words):
        wanted = sorted({int(word) for word in words})
        present, source = gpu_discovery.discover_report()
        missing = [i for i in wanted if i not in {gpu.index for gpu in present}]
        if missing:
            have = ", ".join(str(gpu.index) for gpu in present) or f"none ({source})"
            raise LaunchError(f"%ddp_gpus: no GPU {', '.join(map(str, missing))} here; this kernel's GPUs: {have}")
        choice = ("gpus", wanted)
    else:
        raise LaunchError(f"%ddp_gpus: {text!r} is not a choice: GPU indices like 0,1, 'cpus 3', or 'off'")
    forget()
    job_spec.set_default_devices(lambda: choice)
    kind, value = choice
    return (f"cells that name no devices run on GPU {', '.join(map(str, value))}" if kind == "gpus" else
            f"cells that name no devices run {value} CPU rank{'s' if value != 1 else ''}")


def active_picker() -> GPUPicker | None:
    """The panel in charge of the default devices, if any."""
    return _active


def forget() -> None:
    """Drop the picker's choice: cells that name no devices use every GPU again (or 2 CPU ranks)."""
    global _active
    if _active is not None:
        _active.summary.value = "<i>This choice was dropped; cells that name no devices use the defaults.</i>"
    _active = None
    job_spec.set_default_devices(None)
