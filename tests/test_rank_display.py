"""Rich output from the ranks: display() and plt.show() in a rank show in the cell, in a real kernel."""
import base64

import pytest

from nbrun import run_cells, text

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

SHOWS = """\
%%ddp --cpus 2 --output 0
import matplotlib.pyplot as plt
from IPython.display import HTML, Markdown, display
plt.plot([1, 2, 3], [3, 1, 2])
plt.show()
display(HTML(f"<b>made by rank {rank}</b>"), Markdown(f"*rank {rank}*"))
print("done showing")
"""

PLAIN = """\
%%ddp --cpus 2
import sys
print("IPython", "IPython" in sys.modules, "matplotlib", "matplotlib" in sys.modules)
"""

EVERY_RANK = """\
%%ddp --cpus 2
import matplotlib.pyplot as plt
figure = plt.figure()
plt.plot([rank, rank + 1])
display(figure)
plt.close(figure)
"""


@pytest.mark.timeout(150)
def test_figures_and_html_from_a_rank_arrive_as_rich_outputs(no_leftovers):
    nb, _client = run_cells(["%load_ext ddp_notebook", SHOWS, PLAIN, EVERY_RANK], timeout=120)
    for cell in nb.cells:
        assert "Traceback" not in text(cell), text(cell)
    shows = nb.cells[1]
    shown = [o for o in shows.outputs if o.output_type == "display_data"]
    assert [sorted(o.data) for o in shown] == [["image/png", "text/plain"], ["text/html", "text/plain"],
                                                ["text/markdown", "text/plain"]], shows.outputs
    assert base64.b64decode(shown[0].data["image/png"]).startswith(b"\x89PNG")
    assert shown[0].data["text/plain"].startswith("<Figure size")
    assert shown[1].data["text/html"] == "<b>made by rank 0</b>"  # --output 0: rank 1's never shows
    assert shown[2].data["text/markdown"] == "*rank 0*"
    assert all(o.metadata["ddp_notebook"] == {"rank": 0} for o in shown)
    printed = text(shows)
    assert "[rank 0] shows <Figure size" in printed and "[rank 0] shows <IPython.core.display.HTML object>" in printed
    assert "[rank 1]" not in printed and "[rank 0] done showing" in printed

    # A cell that displays nothing loads neither IPython nor matplotlib in its ranks.
    assert sorted(text(nb.cells[2]).splitlines()) == [f"[rank {r}] IPython False matplotlib False" for r in (0, 1)]

    # display() named without an import (a builtin in the notebook), from every rank.
    figures = [o for o in nb.cells[3].outputs if o.output_type == "display_data"]
    assert sorted(o.metadata["ddp_notebook"]["rank"] for o in figures) == [0, 1]
    assert all("image/png" in o.data for o in figures)
