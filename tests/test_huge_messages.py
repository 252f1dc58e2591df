"""Huge rank messages reach the notebook clipped: an error's message and traceback, a last line, a redrawn line.

The kernel tests measure the iopub messages a real Jupyter kernel sends; the others check the rules without
processes (on arbitrary text, with hypothesis).
"""
import io
import json
import re

import pytest
from hypothesis import given, strategies as st

from ddp_notebook.engine.output import OutputRelay
from ddp_notebook.wire.errors import (SHOWN_MESSAGE_CHARS, SHOWN_TRACEBACK_CHARS, Failure, RankError, clipped,
                                      clipped_lines)
from nbrun import kernel

pytestmark = pytest.mark.timeout(300)

NOTE = re.compile(r" \.\.\.\[ddp_notebook: ([\d,]+) characters cut here; the whole text is in (.*?)\]\.\.\. ")
HUGE = 5_000_000


def _cell_messages(kc, code: str, timeout: int = 180) -> tuple[dict, list[dict]]:
    """Run a cell; its reply's content and every iopub message it made (msg_type, content, size in bytes)."""
    messages = []

    def hook(msg):
        messages.append({"type": msg["msg_type"], "content": msg["content"],
                         "size": len(json.dumps(msg["content"]).encode())})

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"], messages


def _printed(kc, code: str) -> str:
    _, messages = _cell_messages(kc, code, timeout=60)
    return "".join(m["content"].get("text", "") for m in messages if m["type"] == "stream")


@pytest.mark.slow
@pytest.mark.kernel
def test_a_huge_error_and_a_huge_last_line_arrive_clipped_with_where_the_whole_text_is(tmp_path, no_leftovers):
    log_dir = tmp_path / "logs"
    with kernel("%load_ext ddp_notebook\nimport ddp_notebook") as (km, kc):
        # 1. a 5 MB exception: one error message of a few kB (it was 20 MB: message, traceback, twice each)
        reply, messages = _cell_messages(
            kc, f"%%ddp --cpus 2\nif rank == 1:\n    raise ValueError('START' + 'x' * {HUGE} + 'END')")
        assert reply["status"] == "error"
        errors = [m for m in messages if m["type"] == "error"]
        assert len(errors) == 1 and errors[0]["content"]["ename"] == "RankError"
        assert max(m["size"] for m in messages) < 40_000 and sum(m["size"] for m in messages) < 60_000, \
            [(m["type"], m["size"]) for m in messages]
        content = errors[0]["content"]
        shown = "\n".join(content["traceback"])
        for text in content["evalue"], shown:
            assert "rank 1 failed: ValueError: STARTxxx" in text and "xxxEND" in text
            notes = NOTE.findall(text)
            assert notes and all(int(cut.replace(",", "")) > HUGE - SHOWN_TRACEBACK_CHARS for cut, _ in notes)
            assert {where for _, where in notes} == {
                "rank 1's log, job.logs(1) (ddp_notebook.last_job() is the latest job)"}
        assert 'File "Cell In[' in shown and "line 3, in <module>" in shown  # the traceback's frames stay
        # ... and the whole text is where the note says, and on the error
        assert _printed(kc, "job = ddp_notebook.last_job()\n"
                            f"whole = 'START' + 'x' * {HUGE} + 'END'\n"
                            "print(whole in job.logs(1), job.error.failure.message == whole,\n"
                            "      job.error.failure.traceback.rstrip().endswith('ValueError: ' + whole))"
                        ) == "True True True\n"

        # 2. a 5 MB last line (and a 5 MB line redrawn after \r): clipped, with the log file's path in the note
        reply, messages = _cell_messages(
            kc, f"%%ddp --cpus 2 --log-dir {log_dir}\nimport sys\nif rank == 1:\n"
                f"    sys.stdout.write('\\rBAR' + 'y' * {HUGE})\n    sys.stdout.flush()\n"
                "    import time; time.sleep(0.6)\n"
                f"    print('\\nSTART' + 'z' * {HUGE} + 'END')")
        assert reply["status"] == "ok"
        streams = [m for m in messages if m["type"] == "stream"]
        # each within one flush's budget (200 kB/s, 5 a second: 40 kB); the bar is redrawn at that pace while it grows
        assert max(m["size"] for m in streams) < 41_000, [m["size"] for m in streams]
        printed = "".join(m["content"]["text"] for m in streams)
        assert re.search(r"\[rank 1\] STARTz{1000,}" + NOTE.pattern + r"z{1000,}END\n", printed), printed[:300]
        assert re.search(r"\[rank 1\] BARy{1000,}" + NOTE.pattern, printed), printed[:300]
        assert {where for _, where in NOTE.findall(printed)} == {f"rank 1's log, {log_dir / 'rank1.log'}"}
        assert f"START{'z' * HUGE}END\n" in (log_dir / "rank1.log").read_text()

        # 3. an error of a normal size: as it was, whole, no note
        message = "m" * 1_500
        reply, messages = _cell_messages(kc, f"%%ddp --cpus 2\nif rank == 0:\n    raise KeyError('{message}')")
        content = next(m["content"] for m in messages if m["type"] == "error")
        assert content["evalue"].startswith(f"rank 0 failed: KeyError: '{message}'")
        assert f"KeyError: '{message}'" in content["traceback"][-1]
        assert "characters cut" not in content["evalue"] + "".join(content["traceback"])


def test_a_huge_redrawn_line_and_a_huge_line_in_a_busy_flush_are_clipped_to_the_budget():
    out = io.StringIO()
    relay = OutputRelay(out, io.StringIO(), interval=0.2, bytes_per_second=100_000)  # budget: 20,000 per flush
    relay.feed(0, "stdout", b"\r" + b"b" * 300_000)
    relay.feed(1, "stdout", b"short\n" + b"a" * 300_000 + b"\n")
    relay.flush()
    shown = out.getvalue()
    assert len(shown) < 2 * 20_000 + 1_000
    assert "[rank 1] short\n" not in shown  # older than a line over the rank's share: elided
    line, bar = shown.split("\n")[-2:]
    assert line.startswith("[rank 1] aaa") and line.endswith("aaa") and len(line) < 20_000 + 200  # its share (the only rank in it)
    assert bar.startswith("[rank 0] bbb") and len(bar) < 20_000 + 200
    assert [where for _, where in NOTE.findall(shown)] == [
        "rank 1's log, job.logs(1) (ddp_notebook.last_job() is the latest job)",
        "rank 0's log, job.logs(0) (ddp_notebook.last_job() is the latest job)"]
    assert relay.log(1) == "short\n" + "a" * 300_000 + "\n"  # the whole line is in the log


@given(st.text(), st.integers(min_value=2, max_value=500))
def test_clipped_text_keeps_its_start_and_end_and_says_how_much_was_cut(text, limit):
    shown = clipped(text, limit, "the log")
    if len(text) <= limit:
        assert shown == text
        return
    half = limit // 2
    note = f" ...[ddp_notebook: {len(text) - 2 * half:,} characters cut here; the whole text is in the log]... "
    assert shown == text[:half] + note + text[len(text) - half:]


@given(st.lists(st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=300), max_size=40))
def test_clipped_lines_clip_each_long_line_then_the_whole(lines):
    text = "\n".join(lines)
    shown = clipped_lines(text, 100, 1_000, "the log")
    if len(text) <= 1_000 and all(len(line) <= 100 for line in lines):
        assert shown == text
    note_size = len(" ...[ddp_notebook: 0 characters cut here; the whole text is in the log]... ") + 10
    assert len(shown) <= 1_000 + note_size
    if lines and len(text) > 100:
        assert shown.startswith(lines[0][:50]) and shown.endswith(lines[-1][-50:] if len(lines[-1]) >= 50
                                                                  else lines[-1])


def test_a_rank_error_keeps_its_whole_text_and_shows_it_clipped():
    message = "S" + "x" * 100_000 + "E"
    trace = f'Traceback (most recent call last):\n  File "Cell In[3]", line 2, in <module>\nValueError: {message}\n'
    failure = Failure(1, "ValueError", message, trace, 0.0, "user")
    error = RankError(failure, [failure], whole="rank 1's log, /logs/rank1.log")
    assert error.failure.message == message and error.failure.traceback == trace
    assert len(str(error)) < SHOWN_MESSAGE_CHARS * 2 + 1_000
    assert error.summary().startswith("rank 1 failed: ValueError: Sxxx") and error.summary().endswith("xxxE")
    assert error.shown_traceback().startswith('Traceback (most recent call last):\n  File "Cell In[3]"')
    assert error.shown_traceback().endswith("xxxE")
    assert NOTE.findall(error.summary()) == [(f"{100_002 + len('ValueError: ') - SHOWN_MESSAGE_CHARS:,}",
                                              "rank 1's log, /logs/rank1.log")]
    unnamed = RankError(failure, [failure])  # (follow(): no log of the rank here)
    assert NOTE.findall(unnamed.summary())[0][1] == "this error's .failure.message and .failure.traceback"


def test_a_huge_redrawn_line_ended_with_a_huge_line_in_one_flush_stays_within_the_budget():
    """A bar of a line over the budget, drawn, then ended by a print of a line as long within one flush: the bar's
    line is elided (older than a line over the share) and the note that says so must not be padded to the bar's
    width to overwrite it (that wrote twice the budget in one message)."""
    out = io.StringIO()
    relay = OutputRelay(out, io.StringIO(), interval=0.2, bytes_per_second=100_000)  # budget: 20,000 per flush
    relay.feed(1, "stdout", b"\rBAR" + b"y" * 300_000)
    relay.flush()
    drawn = len(out.getvalue())
    assert drawn < 20_000 + 200
    relay.feed(1, "stdout", b"\nSTART" + b"z" * 300_000 + b"END\n")
    relay.flush(final=True)
    written = out.getvalue()[drawn:]
    assert len(written) < 20_000 + 500, len(written)
    assert re.search(r"\[rank 1\] STARTz{1000,}" + NOTE.pattern + r"z{1000,}END\n$", written)
    assert "1 lines of rank 1 elided" in written
    assert written.startswith("\n")  # the bar's line ends where it was drawn
