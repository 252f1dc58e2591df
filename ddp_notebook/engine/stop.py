"""A job's stop: asked from any thread, carried out by the job's own thread (it owns the ranks' connections).

Gracefully where the task checks for it (its ranks said so: ``STOPPABLE``, from a ``distributed_loader`` or
``should_stop()``): every rank is asked to stop at the same batch boundary, and the job ends normally there.  Hard
when asked so, when nothing can stop gracefully, or when no boundary came within the grace: the job's own ranks are
ended (a warm pool brings its ranks back) and the job fails with :class:`~ddp_notebook.wire.errors.JobStopped`
naming who stopped it.
"""
from __future__ import annotations

import time

ANNOUNCE_WAIT_S = 2.0  # how long a task interrupted as it starts has to say that it can stop gracefully


class Stop:
    """Where one job's stop stands; the job reads it on its thread at each pump."""

    def __init__(self, grace: float):
        self.grace = grace  # how long a graceful stop waits for a batch boundary once a rank said it can stop
        self.stoppable: set[int] = set()  # ranks whose task checks for a graceful stop
        self.by = "job.stop()"  # who stopped the job (JobStopped says so)
        self.hard = False  # a hard stop is asked: the job's thread ends the ranks at its next pump
        self.pending: str | None = None  # a graceful stop asked from another thread, for the job's thread to send
        self.by_call = False  # asked by job.stop(), not the cell's interrupt: past the grace it is a hard stop
        self.sent_at: float | None = None  # when the ranks were asked to stop gracefully (monotonic)

    @property
    def asked(self) -> bool:
        """A stop of either kind is asked or under way."""
        return self.hard or self.pending is not None or self.sent_at is not None

    def ask_hard(self, by: str | None = None) -> None:
        """Stop now; ``by`` is who asked (the first to name one is kept)."""
        if by is not None and not self.hard:
            self.by = by
        self.hard = True

    def ask_gracefully(self, by: str) -> None:
        """From another thread: the job's thread sends the stop to the ranks at its next pump."""
        self.by = self.pending = by
        self.by_call = True

    def sent(self) -> None:
        """The ranks were asked to stop at their next batch boundary."""
        self.sent_at = time.monotonic()
        self.pending = None

    def grace_now(self) -> float:
        """How long a graceful stop waits for a batch boundary: the grace once a rank has said its task can stop
        there, else only until the ranks had time to say so."""
        return self.grace if self.stoppable else min(self.grace, ANNOUNCE_WAIT_S)

    def expired(self) -> bool:
        """A graceful stop was sent and no boundary came within :meth:`grace_now`."""
        return self.sent_at is not None and time.monotonic() - self.sent_at > self.grace_now()
