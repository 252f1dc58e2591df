"""The prompt relay: a rank's ``input()``, ``breakpoint()`` and pdb asked in the notebook, answered on the rank.

A job has one :class:`PromptRelay`.  Ranks send ``PROMPT`` messages; the relay asks them in the notebook one at a
time, in the order they came, a rank in its debugger alone until it goes on, and sends each rank its ``ANSWER``:
the line typed, the end of input, or a refusal that says why nothing could ask (no input box reaches a background
job's cell; a front end without stdin).  It knows nothing of ranks' processes: the job gives it the means to send
and to show what a rank printed before it asked.
"""
from __future__ import annotations

import collections
import sys
from typing import Callable

from ..wire import protocol

DEBUG_WAIT_S = 3600  # a process-group timeout this short is told at a rank's first prompt


class PromptRefused(Exception):
    """What answers a job's prompts cannot ask (no stdin in the front end); the message says why, and the rank
    that asked fails with it."""


class PromptRelay:
    """Asks the ranks' prompts of one job with ``prompter`` (None: refused, with the reason ``no_prompter()``
    gives); ``send(rank, message)`` reaches a rank, ``catch_up()`` shows what the ranks printed so far."""

    def __init__(self, task_id: int, prompter: Callable[[str], str] | None, *,
                 send: Callable[[int, tuple], None], catch_up: Callable[[], None],
                 no_prompter: Callable[[], str], world_size: int):
        self.task_id = task_id
        self.prompter = prompter
        self._send = send
        self._catch_up = catch_up
        self._no_prompter = no_prompter
        self._world_size = world_size
        self._waiting: collections.deque = collections.deque()  # (rank, PROMPT body), in the order they came
        self.refusal: str | None = None  # why the prompter could not ask: the later prompts are refused too
        self._told_limit = False  # the user was told how long the other ranks wait for a rank at its prompt
        self.debugging: int | None = None  # the rank in its debugger: the others' prompts wait until it goes on
        self._asking: dict | None = None  # the PROMPT asked in the notebook now (an interrupt leaves it unanswered)

    def take(self, rank: int, body: dict) -> None:
        """A rank's ``PROMPT``: asked at the next :meth:`ask_waiting`, or refused now where nothing can ask."""
        if self.prompter is None:
            self._answer(rank, body, {"refused": self.refusal or self._no_prompter()})
        else:
            self._waiting.append((rank, body))

    def went_on(self, rank: int) -> None:
        """The rank left its debugger (it printed, returned, failed or ended): the others' prompts may be asked."""
        if self.debugging == rank:
            self.debugging = None

    def ask_waiting(self, stopped: Callable[[], bool]) -> str | None:
        """Ask the waiting prompts that may be asked now and send the answers, until ``stopped()``; returns who
        stopped the job (an interrupt at a prompt), else None."""
        while self._waiting and not stopped():
            waiting = [i for i, (rank, _) in enumerate(self._waiting) if self.debugging in (None, rank)]
            if not waiting:
                return None
            rank, body = self._waiting[waiting[0]]
            del self._waiting[waiting[0]]
            if body.get("debugger"):
                self.debugging = rank
            stopped_by = self._ask(rank, body)
            if stopped_by is not None:
                return stopped_by
        return None

    def _ask(self, rank: int, body: dict) -> str | None:
        if self.prompter is None:  # an earlier prompt of this batch found that nothing can ask
            self._answer(rank, body, {"refused": self.refusal or self._no_prompter()})
            return None
        self._catch_up()  # what the rank printed before it asked is shown first
        limit = body.get("group_timeout")
        if limit is not None and limit < DEBUG_WAIT_S and self._world_size > 1 and not self._told_limit:
            self._told_limit = True
            print(f"ddp_notebook: while rank {rank} waits at its prompt, ranks that wait for it in a collective give "
                  f"up {limit:g} s after they began (the process group's timeout; torch.distributed.breakpoint() "
                  f"gives every rank an hour)", file=sys.stderr, flush=True)
        if body.get("said"):
            sys.stdout.write(body["said"])
            sys.stdout.flush()
        self._asking = body
        try:
            answer = {"text": self.prompter(body["prompt"])}
        except EOFError:
            answer = {"eof": True}
        except KeyboardInterrupt:
            return f"an interrupt at the prompt of rank {rank} (the debugger)"
        except Exception as exc:  # noqa: BLE001 - the rank fails with the reason, never waits
            why = str(exc) if isinstance(exc, PromptRefused) else \
                f"the notebook could not ask ({type(exc).__name__}: {exc})"
            self.prompter, self.refusal = None, why  # every later prompt is refused alike, at once
            answer = {"refused": why}
        self._asking = None
        self._answer(rank, body, answer)
        return None

    def debug_session(self, prompter: Callable[[str], str] | None) -> None:
        """A new session of the debugger post mortem: no prompt waits, none was refused, and no rank waits in a
        collective for the one debugged any more (so its timeout is not told)."""
        if prompter is not None:
            self.prompter = prompter
        self._waiting.clear()
        self.refusal = self._asking = None
        self._told_limit = True

    def refuse_all(self, rank: int, why: str) -> None:
        """Refuse the prompt asked now and those waiting, and every later one, with ``why``."""
        self.prompter, self.refusal = None, why
        for body in ([self._asking] if self._asking is not None else []) + [body for _, body in self._waiting]:
            self._answer(rank, body, {"refused": why})
        self._waiting.clear()

    def forget(self) -> None:
        """A restart: the prompts of the failed attempt's ranks go unanswered (those ranks are gone)."""
        self._waiting.clear()
        self.debugging = None

    def _answer(self, rank: int, prompt: dict, answer: dict) -> None:
        self._send(rank, (protocol.ANSWER, {"task": self.task_id, "id": prompt.get("id"), **answer}))
