"""The fair re-entrant lock: granted in arrival order (a thread taking it in a loop lets a
waiter in at its next release), re-entrant, usable by ``threading.Condition``, and a waiter
whose wait is interrupted leaves no ticket behind."""

from __future__ import annotations

import threading
import time

import pytest

from drivetrain.runtime.fair_lock import FairRLock

pytestmark = pytest.mark.timeout(60)


def test_a_thread_looping_on_the_lock_lets_a_waiter_in_at_its_next_release() -> None:
    lock, stop, steps = FairRLock(), threading.Event(), []

    def loop() -> None:  # what a generation loop does: take, step, release, take again
        while not stop.is_set():
            with lock:
                steps.append(1)
                time.sleep(0.002)

    looping = threading.Thread(target=loop)
    looping.start()
    try:
        while len(steps) < 5:
            time.sleep(0.001)
        waits = []
        for _ in range(20):
            begin = time.monotonic()
            with lock:
                waits.append(time.monotonic() - begin)
        assert max(waits) < 0.5, waits  # one step, not the loop's whim
        before = len(steps)
        while len(steps) == before:  # and the loop goes on
            time.sleep(0.001)
    finally:
        stop.set()
        looping.join(10)


def test_it_is_reentrant_and_serves_a_condition() -> None:
    lock = FairRLock()
    ready = threading.Condition(lock)
    seen = []

    def waiter() -> None:
        with lock, lock:  # held twice: the wait releases both levels
            ready.wait_for(lambda: seen, 10)
            seen.append("woke holding it")
            assert lock._is_owned()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)
    with lock:
        seen.append("notified")
        ready.notify_all()
    thread.join(10)
    assert seen == ["notified", "woke holding it"]
    assert lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_a_timed_out_or_refused_waiter_does_not_get_the_lock() -> None:
    lock = FairRLock()
    got = []
    with lock:

        def attempts() -> None:
            got.extend([lock.acquire(timeout=0.05), lock.acquire(blocking=False)])

        thread = threading.Thread(target=attempts)
        thread.start()
        thread.join(10)
    assert got == [False, False]
    assert lock.acquire(timeout=1)  # nothing left in line
    lock.release()


def test_a_waiter_interrupted_on_the_fair_lock_leaves_no_ticket_behind() -> None:
    """A waiter whose wait raises (Ctrl-C) leaves the queue: the next caller still gets in."""
    lock = FairRLock()
    real_wait = lock._cond.wait
    seen = []

    def interrupted(*args, **kwargs):
        lock._cond.wait = real_wait  # only the first waiter is interrupted
        raise KeyboardInterrupt

    def take():
        try:
            with lock:
                seen.append("got it")
        except KeyboardInterrupt:
            seen.append("interrupted")

    with lock:
        lock._cond.wait = interrupted
        first = threading.Thread(target=take)
        first.start()
        first.join(10)
    second = threading.Thread(target=take)
    second.start()
    second.join(10)
    assert seen == ["interrupted", "got it"]
