"""The exit a run takes when its stop grace runs out (:mod:`drivetrain.trainer.stopping`):
the minimum a clean exit does, each part bounded, then ``os._exit``.

Code that owns something the process's end would leave behind (a child process group in a
session of its own, a metrics writer's buffer) says so within ``with on_forced_exit(cb):``;
the forced exit calls these last words newest first (as ``atexit``), each with at most
:data:`LAST_WORD_S` seconds and all of them with at most :data:`LAST_WORDS_S`, so one that
hangs cannot keep the process alive. Only the standard library: anything may import this.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

#: at most this long for each last word (and for each flush): killing a process group or
#: closing a file takes milliseconds; what takes longer is stuck
LAST_WORD_S = 2.0
#: at most this long for all of them: the scheduler's kill comes anyway
LAST_WORDS_S = 10.0

_lock = threading.Lock()
_last_words: list[Callable[[], object]] = []


@contextlib.contextmanager
def on_forced_exit(callback: Callable[[], object]) -> Iterator[None]:
    """Within ``with``: a forced exit calls ``callback`` (from another thread, while the run's
    threads may still be busy) before the process ends; what it raises is ignored."""
    with _lock:
        _last_words.append(callback)
    try:
        yield
    finally:
        with _lock, contextlib.suppress(ValueError):
            _last_words.remove(callback)


def bounded(call: Callable[[], object], seconds: float) -> bool:
    """Call ``call`` in a daemon thread and wait at most ``seconds``; whether it returned
    (whatever it raised). A daemon thread: one that never returns does not hold the exit."""
    thread = threading.Thread(target=_quietly, args=(call,), name="last-word", daemon=True)
    thread.start()
    thread.join(max(seconds, 0.0))
    return not thread.is_alive()


def forced_exit(status: int, say: Callable[[], object]) -> None:
    """End the process with ``status`` now: flush stdout and stderr, ``say`` (the one line of
    where ``--resume auto`` continues), the last words, a last flush; each bounded."""
    _flush()
    bounded(say, LAST_WORD_S)
    with _lock:
        last_words = list(reversed(_last_words))
    deadline = time.monotonic() + LAST_WORDS_S
    for callback in last_words:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        bounded(callback, min(LAST_WORD_S, left))
    _flush()
    # os._exit, not sys.exit: this runs on a timer thread while the main thread is stuck (in a
    # step, a collective, a hung join); Python cannot unwind another thread, and a normal exit
    # would wait on it (and on non-daemon threads) forever.
    os._exit(status)


def _flush() -> None:
    # bounded: a flush blocks on a full pipe, or on the stream's lock held by a stuck thread
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            bounded(stream.flush, LAST_WORD_S)


def _quietly(call: Callable[[], object]) -> None:
    with contextlib.suppress(BaseException):  # the exit goes on whatever a last word does
        call()
