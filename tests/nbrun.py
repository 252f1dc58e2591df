"""Run notebook cells in a real Jupyter kernel (nbclient) and read their outputs."""
from __future__ import annotations

import nbformat
from nbclient import NotebookClient


def run_cells(cells: list[str], timeout: int = 120, cwd: str | None = None, allow_errors: bool = True):
    """Execute the cells in a fresh python3 kernel; returns (notebook, client)."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=allow_errors,
                            resources={"metadata": {"path": cwd}} if cwd else {})
    client.execute()
    return nb, client


def text(cell) -> str:
    """Everything a cell printed (streams) plus error tracebacks, as plain text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
            parts.append(f"\n{out.ename}: {out.evalue}\n")
    return "".join(parts)


def error(cell):
    """The cell's error output, or None."""
    for out in cell.outputs:
        if out.output_type == "error":
            return out
    return None
