"""The live dashboard as plain display outputs, counted from a real kernel's messages (no browser), on ipykernel 7
and 6: they route output from threads (a background job's) to cells differently."""
import base64
import time

import pytest

from nbrun import IPYKERNEL_VERSIONS, kernel, run_cell

pytestmark = [pytest.mark.slow, pytest.mark.kernel]

SIX_EPOCHS = """\
%%ddp --cpus 2
import time
from ddp_notebook import distributed_loader, report
loader = distributed_loader(list(range(20)), batch_size=2)  # 5 batches a rank, progress reported by the loader
for epoch in range(1, 7):
    for batch in loader:
        time.sleep(0.3)
    report(epoch=epoch, epochs=6, loss=1.0 / epoch + rank)
print("trained")
"""

BACKGROUND = """\
%%ddp --cpus 2 --background
import time
from ddp_notebook import report
for epoch in range(1, 10_000):
    time.sleep(0.3)
    report(epoch=epoch, loss=1.0 / epoch)
    if epoch == 2:
        print("rank", rank, "in epoch 2")
"""


# Another cell, busy until the background job has reported 3 epochs and its dashboard has drawn a figure.
WHILE_IT_TRAINS = """\
import time
from ddp_notebook.notebook.dashboard import DisplayView
job = _2
view = next(v for listener in job.listeners for v in getattr(listener, "views", []) if isinstance(v, DisplayView))
while len(job.history) < 3 or "image/png" not in view.figure_output.data:
    time.sleep(0.1)
time.sleep(1)
print(job.status)
"""


def run_collecting(kc, code: str, timeout: float = 120) -> tuple[str, list[dict]]:
    """Execute ``code``; its msg_id and every iopub message (any parent) until that execution is idle."""
    msg_id = kc.execute(code)
    messages, deadline = [], time.time() + timeout
    while time.time() < deadline:
        msg = kc.get_iopub_msg(timeout=deadline - time.time())
        messages.append(msg)
        if (msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                and msg["parent_header"].get("msg_id") == msg_id):
            return msg_id, messages
    raise AssertionError(f"{code[:40]!r} did not finish within {timeout} s")


def display_messages(messages, msg_id):
    return [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")
            and m["parent_header"].get("msg_id") == msg_id]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ipykernel", IPYKERNEL_VERSIONS)
def test_the_dashboard_updates_in_place_with_png_and_text(no_leftovers, ipykernel):
    with kernel(ipykernel=ipykernel) as (_km, kc):
        msg_id, messages = run_collecting(kc, SIX_EPOCHS)
        shown = display_messages(messages, msg_id)
        created = [m for m in shown if m["msg_type"] == "display_data"]
        updates = [m for m in shown if m["msg_type"] == "update_display_data"]
        ids = {m["content"]["transient"]["display_id"] for m in created}
        # Two outputs (status, figure), made once; every later change replaces one of them.
        assert len(created) == 2 and len(ids) == 2, [m["content"]["data"] for m in created]
        assert all(m["content"]["transient"]["display_id"] in ids for m in updates)
        assert not any("application/vnd.jupyter.widget-view+json" in m["content"]["data"] for m in shown)
        figures = [m["content"]["data"] for m in updates if "image/png" in m["content"]["data"]]
        live = [f for f in figures if not f["text/plain"].startswith("done")]
        assert len(live) >= 3, [f["text/plain"] for f in figures]
        assert len({f["image/png"] for f in live}) >= 3  # the figure changes while the job runs
        assert all(base64.b64decode(f["image/png"]).startswith(b"\x89PNG") for f in figures)
        assert "ranks alive · epoch" in live[-1]["text/plain"]
        assert figures[-1]["text/plain"].startswith("done · 2 ranks · epoch 6/6")
        statuses = [m["content"]["data"]["text/plain"] for m in updates if "image/png" not in m["content"]["data"]]
        assert any("ranks alive · epoch" in s and "batches" in s for s in statuses), statuses
        assert statuses[-1].startswith("ddp_notebook · done · 2 ranks · epoch 6/6")
        # The per-rank panel: both ranks' pace, data wait and memory; no DDP here, so nobody waits for anybody.
        panel = statuses[-1].splitlines()[1:]
        assert [line.split(":")[0] for line in panel] == ["rank 0", "rank 1", "straggler"], statuses[-1]
        assert all(" samples/s · data wait " in line and "MiB resident" in line for line in panel[:2])
        assert panel[2] == "straggler: none (the ranks keep pace)"
        assert any(m["msg_type"] == "stream" and "[rank 0] trained" in m["content"]["text"] for m in messages)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ipykernel", IPYKERNEL_VERSIONS)
def test_a_background_dashboard_updates_its_own_cell_while_others_run(no_leftovers, ipykernel):
    with kernel(ipykernel=ipykernel) as (_km, kc):
        started, messages = run_collecting(kc, BACKGROUND)
        created = [m for m in display_messages(messages, started) if m["msg_type"] == "display_data"]
        widgets = [m for m in created if "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
        assert len(widgets) == 1  # the Stop button, the one control
        assert len(created) == 4  # the ranks' output, the button, the status, the figure
        assert "_2.stop() does the same" in widgets[0]["content"]["data"]["text/plain"]
        # Another cell runs for a while; the dashboard's updates still carry the background cell as parent.
        other, messages = run_collecting(kc, WHILE_IT_TRAINS)
        updates = [m for m in messages if m["msg_type"] == "update_display_data"]
        assert updates and all(m["parent_header"]["msg_id"] == started for m in updates)
        texts = [m["content"]["data"]["text/plain"] for m in updates if "image/png" not in m["content"]["data"]]
        assert any("ranks alive · epoch" in t and "stop it: the Stop button, or _2.stop()" in t for t in texts), texts
        assert any("image/png" in m["content"]["data"] for m in updates)
        assert any("[rank 1] rank 1 in epoch 2" in m["content"]["data"]["text/plain"] for m in updates)
        assert not [m for m in messages if m["msg_type"] == "update_display_data"
                    and m["parent_header"]["msg_id"] == other]
        _, messages = run_collecting(kc, "job.stop()\nprint(job.status)")
        assert any(m["msg_type"] == "stream" and "stopped" in m["content"]["text"] for m in messages)
        final = [m["content"]["data"] for m in messages if m["msg_type"] == "update_display_data"
                 and m["parent_header"]["msg_id"] == started]
        assert {"text/plain": ""} in final  # the Stop button leaves
        assert any(d["text/plain"].startswith("ddp_notebook · stopped") for d in final)


RANK_0_ONLY = """\
%%ddp --cpus 2
import time
from ddp_notebook import report
for s in range(60):
    time.sleep(0.15)
    if rank == 0:
        report(step=s, steps=60, loss=1.0 / (s + 1))
"""


@pytest.mark.timeout(200)
def test_reports_of_rank_0_alone_show_live_labelled_and_the_history_keeps_every_step(no_leftovers):
    with kernel() as (_km, kc):
        msg_id, messages = run_collecting(kc, RANK_0_ONLY)
        updates = [m for m in display_messages(messages, msg_id) if m["msg_type"] == "update_display_data"]
        statuses = [m["content"]["data"]["text/plain"] for m in updates if "image/png" not in m["content"]["data"]]
        live = [s for s in statuses if "ranks alive · step" in s]
        # The steps count up while the job runs (the first ones wait the settling time for rank 1; the first
        # figure waits for matplotlib's import), not only when it ends.
        counts = sorted({int(s.split("ranks alive · step ")[1].split("/")[0]) for s in live})
        assert len([c for c in counts if 0 < c < 60]) >= 3, statuses
        figures = [m["content"]["data"] for m in updates if "image/png" in m["content"]["data"]]
        assert len([f for f in figures if not f["text/plain"].startswith("done")]) >= 2
        assert statuses[-1].startswith("ddp_notebook · done · 2 ranks · step 60/60"), statuses[-1]
        _, told = run_cell(kc, "import ddp_notebook\nh = ddp_notebook.last_job().history\n"
                               "print([r['step'] for r in h] == list(range(60)), h.reporters,\n"
                               "      all(r['loss'] == 1.0 / (r['step'] + 1) and 'partial' not in r for r in h))")
        assert told.strip() == "True {'loss': [0]} True", told
