"""A rollout host that steps between the calls it serves (the rollout server process's
background generation): polls only collect, the tokens are those of a polled rollout, a step
that raises fails the next poll and ends the stepping."""

from __future__ import annotations

from dataclasses import replace

import pytest

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.api.requests import Request
from drivetrain.runtime.remote_rollout import RolloutHost
from drivetrain.testing.fake_rollout import FakeRollout, FakeRolloutConfig

pytestmark = pytest.mark.timeout(60)
PARAMS = SamplingParams(max_new_tokens=12, ignore_eos=True)


def rollout() -> FakeRollout:
    return FakeRollout(FakeRolloutConfig(max_model_len=64, seed=3))


def submit(host: RolloutHost) -> None:
    host.call("submit", [Request(f"r{i}", (1 + i, 2), replace(PARAMS, seed=i)) for i in range(3)])


def test_the_host_steps_between_calls_and_polls_only_collect() -> None:
    host = RolloutHost(rollout(), steps_between_calls=True)
    assert host.call("background_generation", True) is True
    submit(host)
    assert host.call("poll", 0.5) == []  # nothing stepped yet, and a poll never steps or waits
    steps = 0
    while host.step():
        steps += 1
    chunks = host.call("poll", 0.0)
    assert steps == 12 and {c.finish_reason for c in chunks} == {FinishReason.LENGTH}
    want = rollout().generate(
        [Prompt(token_ids=(1 + i, 2)) for i in range(1)], replace(PARAMS, seed=0)
    )
    assert next(c for c in chunks if c.request_id == "r0").token_ids == want[0].token_ids
    host.call("background_generation", False)
    assert not host.step()  # back to stepping when polled


def test_a_failing_step_fails_the_next_poll_and_stops_the_stepping() -> None:
    r = rollout()
    host = RolloutHost(r, steps_between_calls=True)
    host.call("background_generation", True)

    def broken(joining, aborted):
        raise RuntimeError("the backend crashed mid-step")

    r.requests._step = broken
    submit(host)
    assert host.step() is False
    with pytest.raises(RuntimeError, match="crashed mid-step"):
        host.call("poll", 0.0)
    assert not r.requests.in_background
    assert {c.finish_reason for c in host.call("poll", 0.0)} == {FinishReason.ABORT}


def test_a_host_without_a_serving_loop_hands_it_to_the_rollout() -> None:
    r = rollout()
    host = RolloutHost(r)
    assert host.call("background_generation", True) is True  # the rollout's own thread
    assert r.requests._background is not None and not host.step()
    host.call("shutdown")
    assert r.requests._background is None
