"""A rank's matplotlib backend (``MPLBACKEND=module://ddp_notebook.rank.mpl_backend``).

Agg drawing; ``plt.show()`` sends the open figures to the notebook cell
(:func:`ddp_notebook.rank.display.send_figures`).  matplotlib imports this module
only when a cell uses pyplot.
"""
from matplotlib.backends.backend_agg import FigureCanvasAgg as FigureCanvas  # noqa: F401 - what pyplot asks for

from .display import send_figures


def show(*_args, **_kwargs) -> None:
    """Every open figure to the notebook, as ``image/png``."""
    send_figures()
