"""Debugging a rank from the notebook, as a person at a Jupyter front end does it: ``breakpoint()``, ``pdb``,
``torch.distributed.breakpoint()`` and ``input()`` in a rank prompt in the notebook's input box (the kernel's
``input_request``, answered here by a kernel client), one rank at a time; ``q``, the end of input and an interrupt
at the prompt end the job with nothing left; a front end without stdin makes the prompt fail at once."""
from __future__ import annotations

import contextlib
import re

import pytest

from nbrun import gone, kernel, run_answering

pytestmark = [pytest.mark.timeout(300), pytest.mark.kernel]

SETUP = "%load_ext ddp_notebook"
PIDS = re.compile(r"PID (\d+)")


def pids(told: str) -> set[int]:
    return {int(p) for p in PIDS.findall(told)}


def debugger_text(told: str) -> str:
    """What the debugger wrote: without the ranks' own lines and ddp_notebook's notes, which other ranks' output
    may put anywhere between."""
    return "".join(line for line in told.splitlines(True) if not line.startswith(("[rank ", "ddp_notebook: ")))


@pytest.fixture(scope="module")
def kc():
    with kernel(SETUP) as (km, client):
        client.km = km
        yield client


@contextlib.contextmanager
def _pool(kc):
    """(manager, client) of the module's kernel with a warm pool of 2 CPU ranks, stopped afterwards."""
    reply, told, _ = run_answering(kc, "%ddp_start --cpus 2", [])
    assert reply["status"] == "ok", told
    try:
        yield kc.km, kc
    finally:
        run_answering(kc, "%ddp_stop", [])


def test_pdb_in_rank_1_shows_its_values_steps_and_goes_on_past_output_0(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2 --output 0 --timeout 90
x = 10 + rank
if rank == 1:
    breakpoint()
    y = x * 2
print("done", rank)
""", ["p x", "w", "n", "p y", "c"])
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 5
    # pdb's own output reaches the notebook although --output 0 hides rank 1's prints
    assert re.search(r"> Cell In\[\d+\], line 5, in <module>\(\)\n-> y = x \* 2\n11\n", debugger_text(told)), told
    assert "\n22\n" in told and "line 6, in <module>()\n-> print(\"done\", rank)" in told
    assert "[rank 0] done 0" in told and "[rank 1] done" not in told
    assert told.count("ddp_notebook: while rank 1 waits at its prompt, ranks that wait for it in a collective give "
                      "up 90 s after they began (the process group's timeout") == 1
    shown_by_w = debugger_text(told).split("11\n", 1)[1].split("> Cell In")[1]
    assert "ddp_notebook" not in shown_by_w and "worker" not in shown_by_w  # w: the cell's frame, no machinery


def test_pdb_commands_list_step_display_return_interact_and_break_in_the_cells_lines(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2 --output 0
def double(v):
    w = v * 2
    return w
total = 0
if rank == 1:
    breakpoint()
    total = double(total + 5)
    total += 1
print("total", rank, total)
""", ["l", "s", "s", "display w", "n", "r", "pp {'w': w}", "interact", "print('inside', w)", "exit()", "b 9", "c",
      "p total", "c"])
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 8 + ["[rank 1] >>> "] * 2 + ["(Pdb rank 1) "] * 4
    shown = debugger_text(told)
    assert "  8  ->\t    total = double(total + 5)\n  9  \t    total += 1\n" in shown  # l: the cell's own lines
    assert "--Call--\n> Cell In[" in shown and "line 3, in double()\n-> w = v * 2\n" in shown  # s, s
    assert "display w: 10  [old: ** raised NameError" in shown  # display, n
    assert "--Return--\n> Cell In[" in shown and "line 4, in double()->10\n" in shown  # r
    assert "{'w': 10}\n*interactive*\ninside 10\n" in shown  # pp; interact's output reaches the notebook too
    assert re.search(r"Breakpoint 1 at Cell In\[\d+\]:9\n> Cell In\[\d+\], line 9, in <module>\(\)\n-> total \+= 1"
                     r"\n10\n", shown), shown  # b 9, c, p total
    assert "[rank 0] total 0 0" in told


def test_input_in_a_rank_gets_the_line_typed_in_the_notebook(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2
lr = float(input("learning rate? ")) if rank == 1 else None
print("lr", rank, lr)
""", ["0.25"])
    assert reply["status"] == "ok", told
    assert prompts == ["[rank 1] learning rate? "]
    assert "[rank 1] lr 1 0.25" in told and "[rank 0] lr 0 None" in told
    assert "learning rate?" not in told  # the prompt is in the input box, not half-written in the rank's output


def test_launch_from_the_notebook_asks_there_too(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """import ddp_notebook, pdb
def ask():
    import os
    value = int(os.environ["RANK"]) * 100
    if value:
        pdb.set_trace()
    return value
print(ddp_notebook.launch(ask, cpus=2))
""", ["p value + 1", "c"])
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 2
    assert "\n101\n" in told and "[0, 100]" in told


def test_dist_breakpoint_up_reaches_the_cell_and_every_rank_goes_on(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2
import torch.distributed as dist
secret = 7 * (rank + 1)
dist.breakpoint(rank=1)
print("after", rank)
""", ["up", "p secret", "c"])
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 3
    assert re.search(r"> Cell In\[\d+\], line 4, in <module>\(\)\n-> dist.breakpoint\(rank=1\)\n14\n",
                     debugger_text(told)), told
    assert "[rank 0] after 0" in told and "[rank 1] after 1" in told
    assert "give up" not in told  # torch's breakpoint gave every rank an hour


def test_two_ranks_at_breakpoints_are_asked_one_at_a_time(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2
mine = ("me", rank)
breakpoint()
print("after", rank)
""", ["p mine", "c", "p mine", "c"])
    assert reply["status"] == "ok", told
    first, second = prompts[0], prompts[2]
    assert prompts == [first, first, second, second] and {first, second} == {"(Pdb rank 0) ", "(Pdb rank 1) "}
    first_rank = int(first[10])
    shown = re.findall(r"\('me', (\d)\)", told)
    assert shown == [str(first_rank), str(1 - first_rank)]  # each rank's own value, in the order they asked
    assert "[rank 0] after 0" in told and "[rank 1] after 1" in told


BREAK_THEN_WAIT = """%%ddp --cpus 2
import os
import torch.distributed as dist
print("PID", os.getpid(), flush=True)
if rank == 1:
    breakpoint()
dist.barrier()
print("after", rank)
"""


@pytest.mark.parametrize("leave", ["q", "EOF", "interrupt"])
def test_quitting_or_interrupting_at_the_prompt_stops_the_job_and_leaves_nothing(kc, leave, no_leftovers):
    answer = (lambda prompt: kc.km.interrupt_kernel()) if leave == "interrupt" else leave
    reply, told, prompts = run_answering(kc, BREAK_THEN_WAIT, [answer])
    assert reply["status"] == "error"
    assert prompts == ["(Pdb rank 1) "]
    how = "an interrupt at the prompt of rank 1 (the debugger)" if leave == "interrupt" else \
        "quitting the debugger of rank 1"
    assert f"was stopped by {how} before it ended" in told, told
    assert gone(pids(told), within=10)  # rank 0 waited in the barrier: stopped too
    reply, told, _ = run_answering(kc, "%%ddp --cpus 2\nprint('next', rank)", [])
    assert reply["status"] == "ok" and "[rank 1] next 1" in told


def test_a_front_end_without_stdin_fails_the_prompt_at_once_saying_why(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, BREAK_THEN_WAIT, [], allow_stdin=False, timeout=60)
    assert reply["status"] == "error" and prompts == []
    assert "rank 1 failed: RuntimeError: rank 1 asked for input ('(Pdb rank 1)'), but this front end takes no " \
           "input (allow_stdin is off: nbconvert, papermill" in told, told
    assert "bdb.py" not in told  # the traceback ends at the cell's line
    assert gone(pids(told), within=10)


def test_a_background_job_refuses_prompts_saying_why(kc, no_leftovers):
    reply, told, _ = run_answering(kc, """%%ddp --cpus 2 --background
x = input("never? ") if rank == 1 else 0
""", [])
    assert reply["status"] == "ok"
    reply, told, prompts = run_answering(kc, """
from ddp_notebook import last_job
try:
    last_job().wait(60)
except Exception as exc:
    print("ERROR", exc)
""", [])
    assert prompts == []
    assert re.search(r"rank 1 asked for input \('\[rank 1\] never\?'\), but job #\d+ runs in the background and its "
                     r"cell has returned, so no input box can reach the notebook", told), told


def test_on_a_warm_pool_an_interrupt_at_the_prompt_leaves_the_pool_usable(kc, no_leftovers):
    with _pool(kc) as (km, client):
        reply, told, prompts = run_answering(client, "%%ddp\nkept = 5\nif rank == 0:\n    breakpoint()\n",
                                             [lambda prompt: km.interrupt_kernel()])
        assert reply["status"] == "error" and prompts == ["(Pdb rank 0) "]
        assert "was stopped by an interrupt at the prompt of rank 0 (the debugger)" in told, told
        reply, told, _ = run_answering(client, "%%ddp\nimport torch.distributed as dist\ndist.barrier()\n"
                                               "print('pool', rank)", [])
        assert reply["status"] == "ok" and "[rank 0] pool 0" in told and "[rank 1] pool 1" in told, told
        run_answering(client, "%ddp_stop", [])


FAILING = """%%ddp --cpus 2{flags}
import os
print("PID", os.getpid(), flush=True)
def inner(v):
    local_value = v * 3
    raise ValueError("bad " + str(v))
if rank == 1:
    inner(41)
import torch.distributed as dist
dist.barrier()
"""


def test_ddp_debug_after_a_failing_debug_cell_walks_the_failing_ranks_traceback(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, FAILING.format(flags=" --debug"), [])
    assert reply["status"] == "error" and prompts == []
    assert "rank 1 failed: ValueError: bad 41" in told
    assert "ddp_notebook: rank 1 waits at its failure: %ddp_debug opens the debugger there" in told
    ranks = pids(told)
    reply, told, prompts = run_answering(kc, "%ddp_debug", ["p local_value", "u", "p rank", "q"])
    assert told.startswith("ddp_notebook: rank 1 of job #")
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 4
    assert re.search(r"> Cell In\[\d+\], line 6, in inner\(\)\n-> raise ValueError\(\"bad \" \+ str\(v\)\)\n123\n"
                     r"> Cell In\[\d+\], line 8, in <module>\(\)\n-> inner\(41\)\n1\n", debugger_text(told)), told
    assert "give up" not in told  # no rank waits for it any more
    assert gone(ranks, within=10)  # quitting ended the rank kept for the debugger
    reply, told, _ = run_answering(kc, "%ddp_debug", [])
    assert "no failed rank to debug: run the cell again with %%ddp --debug" in told


def test_ddp_debug_where_the_front_end_takes_no_input_fails_saying_why(kc, no_leftovers):
    reply, told, _ = run_answering(kc, FAILING.format(flags=" --debug"), [])
    kept = pids(told)
    reply, told, prompts = run_answering(kc, "%ddp_debug", [], allow_stdin=False)
    assert prompts == []
    assert "UsageError: the debugger of rank 1 could not ask: this front end takes no input (allow_stdin is off" \
        in told, told
    assert gone(kept, within=10)


def test_without_debug_the_failing_rank_is_not_kept(kc, no_leftovers):
    reply, told, _ = run_answering(kc, FAILING.format(flags=""), [])
    assert reply["status"] == "error" and "waits at its failure" not in told
    assert gone(pids(told), within=10)
    reply, told, _ = run_answering(kc, "%ddp_debug", [])
    assert "no failed rank to debug" in told


def test_the_next_job_lets_go_of_a_rank_kept_for_the_debugger(kc, no_leftovers):
    reply, told, _ = run_answering(kc, FAILING.format(flags=" --debug"), [])
    kept = pids(told)
    reply, told, _ = run_answering(kc, "%%ddp --cpus 2\nprint('next', rank)", [])
    assert reply["status"] == "ok" and gone(kept, within=10)
    reply, told, _ = run_answering(kc, "%ddp_debug", [])
    assert "no failed rank to debug" in told


def test_launch_debug_true_keeps_the_failing_rank_for_the_debugger(kc, no_leftovers):
    reply, told, _ = run_answering(kc, """import ddp_notebook
def train():
    import os
    print("PID", os.getpid(), flush=True)
    step = int(os.environ["RANK"]) + 5
    if step == 6:
        raise RuntimeError("diverged")
try:
    ddp_notebook.launch(train, cpus=2, debug=True)
except ddp_notebook.RankError as exc:
    print("FAILED", exc.rank)
""", [])
    assert "FAILED 1" in told, told
    reply, told2, prompts = run_answering(kc, "ddp_notebook.last_job().debug()", ["p step", "c"])
    assert reply["status"] == "ok" and prompts == ["(Pdb rank 1) "] * 2
    assert "\n6\n" in told2
    assert gone(pids(told), within=10)


def test_debug_refuses_a_job_on_several_hosts_before_anything_starts(kc):
    reply, told, _ = run_answering(kc, "%%ddp --cpus 1 --nnodes 2 --master-addr 127.0.0.1 --port 29999 --debug\n"
                                       "print(rank)", [])
    assert reply["status"] == "error"
    assert "--debug keeps a failing rank of this host for %ddp_debug; the ranks of a job on several hosts " \
           "(--nnodes) or of a Slurm job (--executor) end with their task" in told, told


def test_a_warm_pools_last_failed_cell_can_be_debugged_without_debug(kc, no_leftovers):
    with _pool(kc) as (km, client):
        reply, told, _ = run_answering(client, "%%ddp\nnumbers = [rank] * 3\nraise KeyError(f'missing {rank}')", [])
        assert reply["status"] == "error" and "KeyError" in told
        reply, told, prompts = run_answering(client, "%ddp_debug", ["p numbers", "c"])
        assert reply["status"] == "ok", told
        rank = int(prompts[0][10])
        assert prompts == [f"(Pdb rank {rank}) "] * 2 and f"[{rank}, {rank}, {rank}]" in told
        reply, told, _ = run_answering(client, "%%ddp\nprint('pool', rank, numbers)", [])
        assert reply["status"] == "ok" and "[rank 1] pool 1 [1, 1, 1]" in told, told
        reply, told, _ = run_answering(client, "%ddp_debug", [])
        assert "no failed rank to debug" in told
        # an interrupt at the post-mortem prompt ends the debugger, and the pool's ranks go on serving cells
        reply, told, _ = run_answering(client, "%%ddp\nraise KeyError(rank)", [])
        assert reply["status"] == "error"
        reply, told, prompts = run_answering(client, "%ddp_debug", [lambda prompt: km.interrupt_kernel()])
        assert len(prompts) == 1 and reply["status"] == "error", told
        assert re.search(r"UsageError: the debugger of rank \d was interrupted; the rank went back to the warm pool",
                         told), told
        reply, told, _ = run_answering(client, "%%ddp\nprint('still', rank, numbers)", [], timeout=60)
        assert reply["status"] == "ok" and "[rank 1] still 1 [1, 1, 1]" in told, told
        run_answering(client, "%ddp_stop", [])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_rank_on_another_node_prompts_in_the_notebook_over_the_channel(kc, tmp_path, no_leftovers):
    from test_torchrun import _agent, _free_port, _running, _stop

    script, port = tmp_path / "job.py", _free_port()
    log = open(tmp_path / "node1.log", "w+")
    node1 = _agent(["--nnodes", 2, "--node-rank", 1, "--nproc-per-node", 1, "--master-addr", "127.0.0.1",
                    "--master-port", port, script], tmp_path, log)
    try:
        flags = f"--nnodes 2 --master-addr 127.0.0.1 --port {port} --cpus 1 --export {script}"
        reply, told, prompts = run_answering(kc, f"""%%ddp {flags}
value = 40 + rank
if rank == 1:
    breakpoint()
import torch.distributed as dist
dist.barrier()
print("after", rank)
""", ["p value", "c"], timeout=150)
        code = node1.wait(60)
    finally:
        _stop([node1])
        log.close()
    assert reply["status"] == "ok", told
    assert prompts == ["(Pdb rank 1) "] * 2
    assert re.search(r"> Cell In\[\d+\], line 5, in <module>\(\)\n-> import torch.distributed as dist\n41\n",
                     debugger_text(told)), told
    assert "[rank 0] after 0" in told and code == 0
    assert _running(str(script)) == []


def test_a_breakpoint_in_a_dataloader_worker_fails_saying_why_and_the_rank_stays_reachable(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2
from torch.utils.data import DataLoader, Dataset
class Asking(Dataset):
    def __len__(self):
        return 2
    def __getitem__(self, i):
        if rank == 1:
            breakpoint()
        return i
try:
    list(DataLoader(Asking(), num_workers=1))
except Exception as exc:
    print("caught", "only the rank itself can ask in the notebook; debug that code with num_workers=0" in str(exc))
print("answer", rank, input("still reachable? ") if rank == 1 else None)
""", ["yes"])
    assert reply["status"] == "ok", told
    assert prompts == ["[rank 1] still reachable? "]
    assert "[rank 1] caught True" in told and "[rank 1] answer 1 yes" in told


def test_pythonbreakpoint_0_turns_breakpoint_off_in_the_ranks_as_in_python(kc, no_leftovers):
    reply, told, prompts = run_answering(kc, """%%ddp --cpus 2
import os
os.environ["PYTHONBREAKPOINT"] = "0"
breakpoint()
print("went on", rank)
""", [])
    assert reply["status"] == "ok" and prompts == [], told
    assert "[rank 0] went on 0" in told and "[rank 1] went on 1" in told


def test_a_warm_pool_that_restarts_after_the_failure_has_no_rank_to_debug_and_says_so(kc, no_leftovers):
    with _pool(kc) as (km, client):
        reply, told, _ = run_answering(client, FAILING.format(flags=" --debug").replace(" --cpus 2", ""), [])
        assert reply["status"] == "error" and "rank 1 failed: ValueError: bad 41" in told
        assert "waits at its failure" not in told  # rank 0 was left in the barrier: the pool restarted its ranks
        reply, told, prompts = run_answering(client, "%ddp_debug", [])
        assert prompts == [] and re.search(r"UsageError: job #\d+ has no rank kept at its failure any more \(its "
                                           r"ranks have ended, or a warm pool ran another task or restarted them\)",
                                           told), told
        run_answering(client, "%ddp_stop", [])
