"""A settled heap: what is alive is frozen (out of full collections), garbage is collected
first, and a settled block leaves everything collectable again."""

from __future__ import annotations

import gc
import weakref

from drivetrain.runtime.heap import settled_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_a_settled_block_freezes_what_is_alive_and_unfreezes_after() -> None:
    garbage = Node()
    freed = weakref.ref(garbage)
    del garbage  # cyclic garbage: collected before freezing, not frozen for good
    kept = Node()
    with settled_heap() as frozen:
        assert freed() is None
        assert frozen > 0 and gc.get_freeze_count() > 0
        assert not any(obj is kept for obj in gc.get_objects())  # out of every generation
    assert gc.get_freeze_count() == 0
    dropped = weakref.ref(kept)
    del kept
    gc.collect()
    assert dropped() is None  # collectable again after the block
