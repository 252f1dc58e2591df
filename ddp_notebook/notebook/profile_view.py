"""Under a ``--profile`` cell: where each rank's time went (text, a stacked bar), and a link to the merged trace."""
from __future__ import annotations

import html
import os
import sys

from ..engine.profiling import CATEGORIES, Profile

_COLORS = {"compute": "#4c72b0", "communication": "#dd8452", "data": "#c44e52", "idle": "#b0b0b0"}


def show(job) -> None:
    """Show ``job.profile`` under the cell: the text, a stacked bar per rank (where matplotlib is), and the trace
    as a link (in a notebook) or a path."""
    found: Profile | None = job.profile
    if job.options.profile is None:
        return
    if found is None:
        print("ddp_notebook: --profile: no profile (the job ended before its ranks sent their traces)",
              file=sys.stderr)
        return
    print(found.text())
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:
        return
    if get_ipython() is None:
        return
    if found.trace:
        relative = os.path.relpath(found.trace)
        link = relative if not relative.startswith("..") else found.trace
        display(HTML(f'<a href="{html.escape(link)}" download>{html.escape(os.path.basename(found.trace))}</a> '
                     f'(download, then open it in <a href="https://ui.perfetto.dev" target="_blank">'
                     f'ui.perfetto.dev</a>: "Open trace file")'))
    if found.summary:
        _bar(found)


def _bar(found: Profile) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ranks = sorted(found.summary)
    fig, ax = plt.subplots(figsize=(6, 0.5 + 0.35 * len(ranks)))
    left = [0.0] * len(ranks)
    for name in CATEGORIES:
        widths = [found.summary[r][name] for r in ranks]
        ax.barh([f"rank {r}" for r in ranks], widths, left=left, label=name, color=_COLORS[name])
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("seconds over the profiled steps")
    ax.invert_yaxis()
    ax.legend(ncol=4, fontsize="small", loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    plt.show()
