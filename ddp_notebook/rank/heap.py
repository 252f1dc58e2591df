"""A rank's imports and Python's cyclic garbage collector.

Importing torch (with ``torch._dynamo``, which a rank's first DDP forward
imports) makes about 300,000 objects that live as long as the process, and
almost no cyclic garbage (about 9,000 objects).  The collector's passes over
them while they are made cost a fifth of the import's CPU (2.8 -> 2.3 CPU-s
measured here), and each later full pass walks them all again (0.2 s) and
writes to their headers, which copies the pages a rank forked from the
template would otherwise share with it.  So the template and a fresh rank
import with the collector off, and freeze what they imported
(:func:`gc.freeze`): no collection walks it again.  User code runs with the
collector on, as in any Python process.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Iterator


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Within: no cyclic garbage collection.  After: every object so far is frozen (never walked by a collection),
    and the collector is as it was."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def settle() -> None:
    """Collect the garbage of everything imported so far, freeze what is left, and give freed heap back to the
    system: what the template does before ranks inherit its pages."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
