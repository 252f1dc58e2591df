"""Installed libraries made up for a test: a module and the dist-info that makes it one, as pip leaves them (the rank
template preloads only what a distribution installs)."""
from __future__ import annotations

import pathlib


def install(folder: pathlib.Path, name: str, code: str, version: str = "1.0") -> None:
    """Module ``name`` with source ``code``, installed in ``folder`` (which the test puts on ``sys.path``)."""
    (folder / f"{name}.py").write_text(code)
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(name + "\n")
