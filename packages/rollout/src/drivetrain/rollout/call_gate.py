"""Pause and resume for a backend that serves whole batch calls (no requests to abort)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class CallGate:
    """:meth:`pause` holds new calls and waits until the running ones returned, so a weight
    update never overlaps a call (which would report the wrong version); :meth:`resume` lets
    calls in again."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = 0
        self._paused = False

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: not self._paused)
            self._running += 1
        try:
            yield
        finally:
            with self._changed:
                self._running -= 1
                self._changed.notify_all()

    def pause(self) -> None:
        with self._changed:
            self._paused = True
            self._changed.wait_for(lambda: self._running == 0)

    def resume(self) -> None:
        with self._changed:
            self._paused = False
            self._changed.notify_all()
