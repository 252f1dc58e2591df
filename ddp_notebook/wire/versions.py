"""What an export records of the notebook's environment, and the check every exported rank makes against it.

Shared by the engine, which writes exports, and the rank side, which runs them.
"""
from __future__ import annotations

import sys

FORMAT = 1
VERSIONED = ("python", "torch", "cloudpickle", "ddp_notebook")
SKIP_CHECK_ENV = "DDP_NOTEBOOK_SKIP_VERSION_CHECK"


def versions() -> dict[str, str]:
    """What the version check compares: the Python minor version and three packages' versions."""
    from importlib import metadata

    from ..version import __version__

    found = {"python": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for name in ("torch", "cloudpickle"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            try:
                found[name] = str(__import__(name).__version__)
            except ImportError:
                found[name] = "not installed"
    found["ddp_notebook"] = __version__
    return found


def _comparable(name: str, version: str) -> str:
    # A CPU notebook exports for a CUDA cluster: 2.13.0+cpu and 2.13.0+cu126 pickle alike.
    return version.split("+")[0] if name == "torch" else version


def version_problems(exported: dict[str, str]) -> list[str]:
    """One line per version that differs between the exporting notebook and this process."""
    here = versions()
    return [f"  {name:<13} {exported[name]} in the notebook, {here.get(name, 'not installed')} here"
            for name in VERSIONED
            if name in exported and _comparable(name, exported[name]) != _comparable(name, here.get(name, ""))]


def version_message(exported: dict[str, str], problems: list[str], script: str) -> str:
    pins = " ".join(f"{name}=={exported[name]}" for name in ("torch", "cloudpickle", "ddp_notebook")
                    if any(line.split()[0] == name for line in problems))
    advice = f"pip install {pins}" if pins else ""
    if any(line.split()[0] == "python" for line in problems):
        advice = (f"a Python {exported['python']} environment" + (f" with {pins}" if pins else "")).strip()
    return (f"ddp_notebook: {script} was exported from a notebook whose versions differ from this environment "
            f"({sys.executable}):\n" + "\n".join(problems) + "\n"
            "The notebook's functions and classes travel as Python bytecode and its objects as pickles, which "
            "do not move between Python versions, nor reliably between library versions.\n"
            f"Run it with {advice}, or export it again from a notebook that matches this environment. "
            f"(To try anyway: {SKIP_CHECK_ENV}=1.)")
