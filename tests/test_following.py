"""follow() of a run the notebook did not start, in a real kernel that reached ddp_notebook by ``import`` alone."""
from __future__ import annotations

import json

import pytest

from ddp_notebook.wire import protocol
from nbrun import error, run_cells, text

pytestmark = pytest.mark.timeout(150)


def _finished_run(run_dir) -> None:
    head = {"run": "r1", "node": 0, "time": 1.0}
    records = [{**head, "event": "start", "world_size": 1, "nnodes": 1},
               {**head, "event": "metric", "rank": 0, "key": "epoch", "x": 0, "values": {"loss": 1.0}},
               {**head, "event": "metric", "rank": 0, "key": "epoch", "x": 1, "values": {"loss": 0.5}},
               {**head, "event": "exit", "rank": 0},
               {**head, "event": "end", "ok": True}]
    with open(protocol.metrics_path(str(run_dir), 0), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.kernel
def test_a_followed_run_shows_in_a_fresh_kernel_after_a_plain_import(tmp_path):
    _finished_run(tmp_path)
    nb, _ = run_cells(["import ddp_notebook",
                       f"run = ddp_notebook.follow({str(tmp_path)!r}, wait=False)\nprint(run.status, run.history)",
                       "run.show()"])
    followed, shown = nb.cells[1], nb.cells[2]
    assert error(followed) is None and error(shown) is None, (followed.outputs, shown.outputs)
    assert "done [{'epoch': 0, 'loss': 1.0}, {'epoch': 1, 'loss': 0.5}]" in text(followed)
    images = [out for out in shown.outputs if out.output_type == "display_data" and "image/png" in out.data]
    assert len(images) == 1 and images[0].data["text/plain"].startswith("done · 1 ranks · epoch 2"), shown.outputs
