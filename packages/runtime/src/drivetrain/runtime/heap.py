"""The heap a process built before its loop, kept out of the garbage collector's full passes.

A process that imported torch and transformers and built a model holds ~400,000 objects the
collector tracks. Each full (generation 2) collection walks all of them: 150-210 ms on this
machine's CPU, one to three times per 30 built-in GRPO steps, in the trainer and in the
rollout server alike. Those pauses land wherever the allocation count happens to cross the
threshold: inside a step's generation in the sync loop, on the trainer's critical path when
generation runs ahead of training. Frozen objects (:func:`gc.freeze`) are not walked; the
collector still runs over what the loop itself allocates, so cycles made there are
reclaimed as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def settle_heap() -> int:
    """Collect what is garbage now, then freeze every object still alive, for the rest of the
    process's life (a server, once it has built what it serves with). The count frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def settled_heap() -> Iterator[int]:
    """:func:`settle_heap` for the block (a training loop), yielding the count frozen; after
    it everything is collectable again (a process that runs one job after another, such as
    a test session, would otherwise keep each job's cyclic garbage for good)."""
    try:
        yield settle_heap()
    finally:
        gc.unfreeze()
