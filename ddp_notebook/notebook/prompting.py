"""The ranks' prompts (``input()``, pdb) answered in the notebook: the kernel's ``input()``, which Jupyter shows as
an input box under the running cell."""
from __future__ import annotations

import builtins
import sys

from ..engine.prompts import PromptRefused

NO_STDIN = ("this front end takes no input (allow_stdin is off: nbconvert, papermill and other runs without a "
            "person at the notebook), so no one can answer it")


def ask_in_notebook(prompt: str) -> str:
    """A line typed in the notebook after ``prompt`` (EOFError at the end of input, KeyboardInterrupt when the
    kernel is interrupted); PromptRefused where the front end cannot ask."""
    try:
        return builtins.input(prompt)
    except Exception as exc:
        errors = sys.modules.get("IPython.core.error")  # (imported wherever the kernel's input() can raise it)
        if errors is not None and isinstance(exc, errors.StdinNotImplementedError):
            raise PromptRefused(NO_STDIN) from None
        raise
