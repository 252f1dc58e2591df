"""``ddp_notebook.runner``: what scripts exported by earlier versions call; see :mod:`ddp_notebook.rank.torchrun`."""
from .rank.torchrun import main  # noqa: F401 (exported scripts call runner.main)
