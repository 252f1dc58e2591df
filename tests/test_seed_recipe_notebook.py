"""notebooks/seed_recipe.ipynb runs top to bottom in a real kernel, as CI runs it."""
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import ROOT
from nbrun import error, kernel_manager, text

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

NOTEBOOK = os.path.join(ROOT, "notebooks", "seed_recipe.ipynb")


@pytest.mark.timeout(240)
def test_the_seed_recipe_notebook_runs_end_to_end(no_leftovers, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, km=kernel_manager(), timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    for cell in code_cells:
        assert error(cell) is None, f"{cell.source[:80]}\n{text(cell)}"
    printed = "".join(text(c) for c in code_cells)
    # The naive save keeps DDP's prefix; load_checkpoint copes with it.
    assert "['module.layers.0.weight', 'module.layers.0.bias']" in printed
    # The best checkpoint, evaluated here on every validation sample, matches what the ranks computed together.
    match = re.search(r"validation accuracy on the ranks (\S+), here (\S+)", printed)
    assert match and match.group(1) == match.group(2) and float(match.group(1)) > 0.8, printed
    assert "'best.pt', 'best.pt.rank0.rng', 'best.pt.rank1.rng', 'pretrained.pt'" in printed
    # The recipe's own ddp_train ran through ddp_notebook.spawn and its save_chkpoint kept a checkpoint.
    assert "the recipe's best checkpoint: criteria" in printed
    assert "['seed_best.pt.rank0.rng', 'seed_best.pt.rank1.rng']" in printed
    removed = re.search(r"removed (\S+)", printed).group(1)
    assert not os.path.exists(removed)
    assert os.listdir(tmp_path) == []  # nothing written into the working directory
