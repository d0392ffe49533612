"""A live-but-silent rollout is named within its progress deadline, a crashed poller fails
its own replica's work only, and closing with stuck pollers is bounded in total."""

from __future__ import annotations

import threading
import time
from concurrent.futures import wait
from dataclasses import replace

import pytest

from drivetrain.api import SamplingParams
from drivetrain.api.errors import RolloutStalled
from drivetrain.api.requests import Request
from drivetrain.runtime.rollout_service import RolloutService, ServiceClosed
from drivetrain.testing.fake_rollout import FakeRollout, FakeRolloutConfig

pytestmark = pytest.mark.timeout(60)


def request(name: str, tokens: int = 8) -> Request:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=1)
    return Request(name, (1, 2, 3), replace(params), prompt_index=0)


def rollout() -> FakeRollout:
    return FakeRollout(FakeRolloutConfig(max_model_len=64, seed=3))


class Silent(FakeRollout):
    """Takes requests, answers every poll, never produces a token (a stuck backend)."""

    def poll(self, timeout_s: float = 0.0):
        time.sleep(0.01)
        return []


def test_a_rollout_that_gives_no_token_fails_its_requests_within_the_deadline():
    silent = Silent(FakeRolloutConfig(max_model_len=64))
    with RolloutService([rollout(), silent], stall_timeout_s=1.0) as service:
        began = time.monotonic()
        stuck = service.submit(1, request("s"))
        with pytest.raises(RolloutStalled) as stalled:
            stuck.result(timeout=20)
        took = time.monotonic() - began
        fine = service.submit(0, request("f")).result(timeout=20)  # the other one goes on
    assert 1.0 <= took < 5, took
    assert len(fine.token_ids) == 8
    message = str(stalled.value)
    assert message.startswith("rollout replica 1 of rollouts (Silent) produced no token for")
    assert "while 1 requests ran on it (rollout.stall_timeout_s=1)" in message
    assert "\n" not in message


def test_without_a_deadline_a_slow_rollout_is_waited_for():
    class Slow(FakeRollout):
        def poll(self, timeout_s: float = 0.0):
            time.sleep(0.3)
            return super().poll(timeout_s)

    with RolloutService([Slow(FakeRolloutConfig(max_model_len=64))], stall_timeout_s=10) as s:
        assert len(s.submit(0, request("a", tokens=4)).result(timeout=30).token_ids) == 4


class Crashing(FakeRollout):
    def poll(self, timeout_s: float = 0.0):
        raise KeyboardInterrupt("a bug in the poller's path")  # not an Exception: a crash


def test_a_crashed_poller_fails_its_own_replica_only():
    with RolloutService([rollout(), Crashing(FakeRolloutConfig(max_model_len=64))]) as service:
        with pytest.raises(ServiceClosed, match="replica 1 of the rollout service"):
            service.submit(1, request("x")).result(timeout=20)
        with pytest.raises(ServiceClosed, match="replica 1"):
            service.submit(1, request("y")).result(timeout=20)
        assert len(service.submit(0, request("z")).result(timeout=20).token_ids) == 8


class Hung(FakeRollout):
    """A poll that does not return until released."""

    release = threading.Event()
    entered = threading.Semaphore(0)

    def poll(self, timeout_s: float = 0.0):
        Hung.entered.release()
        Hung.release.wait()
        return super().poll(timeout_s)


def test_closing_with_stuck_pollers_is_bounded_in_total():
    config = FakeRolloutConfig(max_model_len=64)
    service = RolloutService([Hung(config), Hung(config), Hung(config)])
    try:
        for replica in range(3):
            service.submit(replica, request(f"r{replica}"))
        for _ in range(3):  # each poller is inside its hung poll
            assert Hung.entered.acquire(timeout=20)
        began = time.monotonic()
        service.close(timeout_s=1.0)
        assert time.monotonic() - began < 2.0  # was up to 1 s per stuck poller
    finally:
        Hung.release.set()


def test_silence_while_excused_is_no_stall_and_the_deadline_starts_afresh_after():
    """A weight sync pauses the rollouts (colocated ones sleep through the update): their
    owner's doing, not a stall."""
    silent = Silent(FakeRolloutConfig(max_model_len=64))
    with RolloutService([silent], stall_timeout_s=1.0) as service:
        with service.excused():
            stuck = service.submit(0, request("s"))
            done, _ = wait([stuck], timeout=2.5)
            assert not done  # 2.5 s of silence, excused
        left = time.monotonic()
        with pytest.raises(RolloutStalled):
            stuck.result(timeout=20)
        assert time.monotonic() - left >= 1.0
