"""A rank's keyboard is the notebook's: ``input()``, ``breakpoint()``, ``pdb.set_trace()`` and
``torch.distributed.breakpoint()`` in a rank ask through the notebook's stdin (Jupyter's input box).

A line read in a rank is a :data:`~ddp_notebook.wire.protocol.PROMPT` message carrying the prompt, and a wait for
the notebook's :data:`~ddp_notebook.wire.protocol.ANSWER`: the typed line, the end of input, or a refusal that says
why no one can answer (no stdin in the front end, a background job), which fails the rank at once.  The debugger
(:class:`RankPdb`) writes to the notebook in its messages, never to the rank's output, so ``--output 0`` does not
hide it; its prompt names the rank and its frames name cells as the notebook does ("Cell In[3], line 4").
Rank side: no IPython here.
"""
from __future__ import annotations

import bdb
import builtins
import io
import itertools
import os
import pdb
import sys
from typing import Callable

from ..wire import payload, protocol
from . import context

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_CHANNEL = ("input() in a rank: this rank has no connection to the notebook (it reports through files), so no "
              "prompt can reach anyone; ask in the notebook before the job and pass the value to it")

_send: Callable[[str, dict], None] | None = None  # sends a message to the notebook now
_receive_answer: Callable[[], dict] | None = None  # waits for the notebook's ANSWER
_prompts = itertools.count(1)  # each prompt's id, which its answer carries
_rank_pid: int | None = None  # the rank's process: a child it forked (a DataLoader worker) shares its channel
NOT_THE_RANK = ("input() in a process the rank started (a DataLoader worker, say): only the rank itself can ask in "
                "the notebook; debug that code with num_workers=0")


class Keyboard(io.TextIOBase):
    """A rank's ``sys.stdin``: each line read is asked of the notebook.  ``echo``: the debugger's output, whose
    unended last line (its prompt) becomes the prompt shown in the notebook and the rest is shown above it."""

    def __init__(self, echo: "NotebookText | None" = None):
        super().__init__()
        self._echo = echo

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:
        if self._echo is None:
            return ask_line(f"{_label()} ")
        said, prompt = self._echo.take()
        return ask_line(prompt, said, debugger=True)

    def read(self, size: int | None = -1) -> str:
        return self.readline()

    def close(self) -> None:
        pass  # (exit() in pdb's interact closes sys.stdin: the rank's keyboard stays)


class NotebookText(io.TextIOBase):
    """What a rank's debugger writes: kept until its next prompt, which carries it to the notebook (or
    :data:`~ddp_notebook.wire.protocol.SAID` does, as the debugger lets the rank go on)."""

    def __init__(self):
        super().__init__()
        self._text: list[str] = []

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._text.append(text)
        return len(text)

    def take(self) -> tuple[str, str]:
        """(what was written up to its last newline, the unended rest), forgetting both."""
        text, self._text = "".join(self._text), []
        head, newline, tail = text.rpartition("\n")
        return head + newline, tail

    def let_go(self) -> None:
        """The debugger lets the rank go on: what it wrote since its last prompt goes to the notebook, which may
        ask other ranks' prompts again."""
        said, prompt = self.take()
        _message(protocol.SAID, {"text": said + prompt})


def install(send: Callable[[str, dict], None] | None, receive_answer: Callable[[], dict] | None) -> None:
    """Make the rank's keyboard the notebook's: ``sys.stdin``, ``input()``, ``breakpoint()``, ``pdb.set_trace()``
    and ``torch.distributed.breakpoint()`` (when torch.distributed is imported).  ``send(kind, body)`` sends now;
    ``receive_answer()`` waits for the notebook's answer (None, None: no connection, reading fails saying so)."""
    global _send, _receive_answer, _rank_pid
    _send, _receive_answer, _rank_pid = send, receive_answer, os.getpid()
    sys.stdin = Keyboard()
    builtins.input = ask
    sys.breakpointhook = _breakpoint
    pdb.set_trace = set_trace
    dist = sys.modules.get("torch.distributed")
    # torch's own debugger opens /dev/stdin: made by _make_distributed_pdb() in torch 2.6 on, _DistributedPdb() before.
    for maker in ("_make_distributed_pdb", "_DistributedPdb") if dist is not None else ():
        if hasattr(dist, maker):
            setattr(dist, maker, RankPdb)


def ask(prompt: object = "") -> str:
    """``input()`` in a rank: the prompt, labelled with the rank, is shown in the notebook's input box."""
    line = ask_line(f"{_label()} {prompt}")
    if not line:
        raise EOFError
    return line[:-1] if line.endswith("\n") else line


def ask_line(prompt: str, said: str = "", debugger: bool = False) -> str:
    """The line typed in the notebook after ``prompt`` (``said`` is shown above it), with its newline; "" at the
    end of input.  Raises RuntimeError with the notebook's reason when no one can answer.  ``debugger``: the
    notebook asks this rank alone until its debugger lets it go on (SAID)."""
    if _send is None or _receive_answer is None:
        raise RuntimeError(NO_CHANNEL)
    if os.getpid() != _rank_pid:  # its messages would break the rank's channel
        raise RuntimeError(NOT_THE_RANK)
    for stream in (sys.stdout, sys.stderr):  # what the rank printed first is shown first
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    asked = next(_prompts)
    _message(protocol.PROMPT, {"id": asked, "prompt": prompt, "said": said, "debugger": debugger,
                               "group_timeout": _group_timeout()})
    answer = _receive_answer()
    while answer.get("id") != asked:  # (an answer to a prompt an interrupt ended)
        answer = _receive_answer()
    if "refused" in answer:
        raise RuntimeError(f"{_label()[1:-1]} asked for input ({prompt.strip()!r}), but {answer['refused']}")
    if answer.get("eof"):
        return ""
    return answer["text"] + "\n"


def _group_timeout() -> float | None:
    """The process group's timeout in seconds (how long the other ranks wait for this one in a collective), or
    None without a group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(context.current().device or "cpu").options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - torch's private names moved: the notebook says nothing of it
        return None


def _message(kind: str, body: dict) -> None:
    if _send is None or os.getpid() != _rank_pid:
        return  # no channel, or a child the rank forked: nothing of its may go on the rank's channel
    ctx = context.current()
    _send(kind, {"task": ctx.task_id if ctx is not None and ctx.task is not None else 0, **body})


def _label() -> str:
    ctx = context.current()
    return f"[rank {ctx.rank}]" if ctx is not None else "[rank ?]"


def _ours(frame) -> bool:
    """A frame of ddp_notebook's own (the task's machinery), or of the interpreter's start above it."""
    filename = frame.f_code.co_filename
    return filename.startswith(_PACKAGE_DIR + os.sep) or filename.startswith("<frozen ")


class RankPdb(pdb.Pdb):
    """pdb in a rank, through the notebook: ``(Pdb rank K)`` prompts, the cell's own lines, no frames of the
    machinery that runs the task (stepping out of the task lets the rank go on)."""

    def __init__(self):
        self._text = NotebookText()
        super().__init__(stdin=Keyboard(self._text), stdout=self._text, skip=["ddp_notebook.*"], nosigint=True,
                         readrc=False)
        ctx = context.current()
        self.prompt = f"(Pdb rank {ctx.rank if ctx is not None else '?'}) "
        self._machinery: set = set()  # frames of the task's machinery, above the user's code

    def interaction(self, frame, traceback) -> None:
        try:
            super().interaction(frame, traceback)
        finally:
            self._text.let_go()

    def message(self, msg: str) -> None:
        for filename, label in payload.traceback_labels().items():  # "Breakpoint 1 at Cell In[3]:9"
            msg = msg.replace(filename, label)
        super().message(msg)

    def do_interact(self, arg):
        streams = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.stdout  # what the interpreter shows goes to the notebook too
        try:
            return super().do_interact(arg)
        except SystemExit:  # exit() leaves the interactive interpreter, not the rank
            return None
        finally:
            sys.stdout, sys.stderr = streams

    def get_stack(self, frame, traceback):
        stack, index = super().get_stack(frame, traceback)
        first = next((i for i, (f, _) in enumerate(stack[:index + 1]) if not _ours(f)), 0)  # the user's code
        self._machinery.update(f for f, _ in stack[:first])
        return stack[first:], index - first

    def stop_here(self, frame) -> bool:
        if frame in self._machinery:  # the user's code has returned to the task that ran it: nothing to step
            self.set_continue()
            return False
        return super().stop_here(frame)

    def format_stack_entry(self, frame_lineno, lprefix: str = ": ") -> str:
        entry = super().format_stack_entry(frame_lineno, lprefix)
        frame, lineno = frame_lineno
        label = payload.traceback_labels().get(frame.f_code.co_filename)
        if label is None:
            return entry
        where = f"{self.canonic(frame.f_code.co_filename)}({lineno!r})"
        return entry.replace(where, f"{label}, line {lineno}, in ", 1)


def set_trace(*, header: str | None = None) -> None:
    """``pdb.set_trace()`` in a rank: stop in the caller, in :class:`RankPdb`."""
    debugger = RankPdb()
    if header is not None:
        debugger.message(header)
    debugger.set_trace(sys._getframe().f_back)


def _breakpoint(*args, **kwargs) -> None:
    """``breakpoint()`` in a rank: as :func:`set_trace`; ``PYTHONBREAKPOINT=0`` turns it off, as in Python."""
    if os.environ.get("PYTHONBREAKPOINT") == "0":
        return
    debugger = RankPdb()
    debugger.set_trace(sys._getframe().f_back)


_failure: tuple[int, BaseException] | None = None  # (task, exception): the failure kept for post-mortem debugging


def keep_failure(task_id: int | None, exc: BaseException | None) -> None:
    """Keep the task's failure for :func:`debug_failure` (its frames and their locals live on); None forgets it."""
    global _failure
    _failure = None if exc is None else (task_id, exc)


def debug_failure(task_id: int) -> None:
    """The debugger post mortem at the kept failure of task ``task_id``, its traceback walked with ``u``/``d``
    (the task's machinery left out); then the notebook is told (DEBUGGED), whether the user quit or continued."""
    try:
        if _failure is None or _failure[0] != task_id:
            _message(protocol.SAID, {"text": f"{_label()[1:-1]} holds no failure of job #{task_id} to debug\n"})
            return
        debugger = RankPdb()
        debugger.reset()
        try:
            debugger.interaction(None, _failure[1].__traceback__)
        except bdb.BdbQuit:
            pass
        except RuntimeError as exc:  # refused: no one can answer
            _message(protocol.SAID, {"text": f"{exc}\n"})
    finally:
        _message(protocol.DEBUGGED, {})


def leave_out_debugger(exc: BaseException) -> None:
    """Cut ``exc``'s traceback where it enters the debugger's own frames (bdb's trace function): a failure at a
    prompt (a refusal, an interrupt) shows the user's line, not pdb's."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        if tb.tb_next.tb_frame.f_code.co_filename == bdb.__file__:
            tb.tb_next = None
            return
        tb = tb.tb_next


def quit_by_debugger(exc: BaseException) -> bool:
    """Whether ``exc`` is the user quitting a rank's debugger (``q``, the end of input)."""
    return isinstance(exc, bdb.BdbQuit)
