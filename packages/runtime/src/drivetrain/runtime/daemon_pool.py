"""A thread pool whose work can be abandoned: plugin code (an environment's ``reset`` and
``step``, a tool) that never returns must not keep the process alive.

``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter exits
(``concurrent.futures.thread._python_exit``), so one hung call turns a run's clean one-line
failure into a process that never exits. Here the workers are daemon threads and
:meth:`DaemonPool.abandon` returns at once: a worker stuck in a call is left to the
interpreter's exit, and the pool's size bounds how many can be stuck.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = object()


class DaemonPool:
    """``workers`` daemon threads running submitted calls in order of submission."""

    def __init__(self, workers: int, *, name: str) -> None:
        if workers < 1:
            raise ValueError(f"a pool needs at least one worker, got {workers}")
        self.name = name
        self._work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"{name}-{k}", daemon=True)
            for k in range(workers)
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """``fn(*args)`` on a free worker; its future gets the result or the exception."""
        if self._closed:
            raise RuntimeError(f"pool {self.name} is closed")
        future: Future[T] = Future()
        self._work.put((future, fn, args))
        return future

    def abandon(self) -> None:
        """No more work: queued calls are cancelled, idle workers end, a worker inside a call
        ends when (if ever) the call returns. Returns at once."""
        self._closed = True
        while True:
            try:
                item = self._work.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].cancel()
        for _ in self._threads:
            self._work.put(_STOP)

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # the caller's to judge (a plugin's SystemExit too)
                future.set_exception(exc)
            else:
                future.set_result(result)
            del future, fn, args, item  # a finished call's objects do not outlive it here
