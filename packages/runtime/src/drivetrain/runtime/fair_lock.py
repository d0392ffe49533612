"""A re-entrant lock granted in arrival order.

A thread that takes a lock in a loop (a poller, a generation loop stepping tokens) releases it
and takes it again at once; with a plain lock it wins almost every time, so a weight update
waiting for it waited ~0.1-0.2 s per call (``weight_sync/pause_s`` and ``resume_s`` in an async
run's metrics; ``benchmarks/async_grpo.py``: async 9.6 s -> 7.1 s for 20 steps once the rollout
process's connection took this lock). It works with ``threading.Condition`` as an ``RLock``
does (a wait releases every level the owner holds and takes them back).
"""

from __future__ import annotations

import collections
import threading


class FairRLock:
    """``threading.RLock``'s interface, granted first come, first served."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: collections.deque[object] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if not blocking and (self._owner is not None or self._queue):
                return False
            return self._wait_turn(me, None if timeout < 0 else timeout)

    def _wait_turn(self, me: int, timeout: float | None) -> bool:
        """Under ``_cond``: queue up and take the lock when first in line and free."""
        ticket = object()
        self._queue.append(ticket)
        try:
            granted = self._cond.wait_for(
                lambda: self._owner is None and self._queue[0] is ticket, timeout
            )
        finally:  # granted, timed out or interrupted: the ticket leaves the line
            self._queue.remove(ticket)
            self._cond.notify_all()  # whoever is first in line now may go
        if granted:
            self._owner, self._depth = me, 1
        return granted

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("cannot release un-acquired lock")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- what threading.Condition uses --------------------------------------------------
    def _is_owned(self) -> bool:
        return self._owner == threading.get_ident()

    def _release_save(self) -> int:
        with self._cond:
            depth, self._owner, self._depth = self._depth, None, 0
            self._cond.notify_all()
            return depth

    def _acquire_restore(self, depth: int) -> None:
        me = threading.get_ident()
        with self._cond:
            self._wait_turn(me, None)
            self._depth = depth
