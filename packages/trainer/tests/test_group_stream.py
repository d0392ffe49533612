"""Generation ahead of training on the pure-Python fake rollout: a stream that never runs ahead
generates what the sync loop generates; partial rollouts keep their tokens and versions;
stale groups are dropped; a failing rollout fails the trainer's next take; validation can
generate in between; closing leaves nothing running."""

from __future__ import annotations

import time

import pytest

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.testing import fake_model
from drivetrain.testing.fake_rollout import FakeRollout, FakeRolloutConfig
from drivetrain.trainer.rl.batch_ops import stream_stats
from drivetrain.trainer.rl.group_stream import GenerationError, GroupStream

pytestmark = pytest.mark.timeout(60)

PER_STEP, N, STEPS = 3, 2, 4
PROMPTS = [(1, 2), (3,), (4, 5, 6), (7,), (8, 9), (10,)]


def params(step: int) -> SamplingParams:
    return SamplingParams(n=N, max_new_tokens=6, seed=1000 + step)


def step_prompts(step: int) -> list[int]:
    return [(step * PER_STEP + i) % len(PROMPTS) for i in range(PER_STEP)]


def rollout(**overrides) -> FakeRollout:
    return FakeRollout(FakeRolloutConfig(max_model_len=64, seed=3, **overrides))


def stream(rollouts, **overrides) -> GroupStream:
    options = dict(
        prompts=step_prompts,
        prompt_ids=lambda i: PROMPTS[i],
        params=params,
        per_step=PER_STEP,
        steps=STEPS,
        max_staleness=0,
        ordered=False,
        drop_stale=True,
    )
    return GroupStream(RolloutService(rollouts, threads=False), **{**options, **overrides})


def new_weights(r: FakeRollout, version: int) -> None:
    """A weight update that changes the model (so versions sample differently)."""
    bias = [b + 0.5 * version * (i % 3) for i, b in enumerate(r.weights[fake_model.BIAS])]
    r.update_weights([(fake_model.BIAS, bias)], version=version)


def flatten(taken) -> list[tuple]:
    return [(c.token_ids, c.log_probs) for g in taken.groups for c in g.completions]


@pytest.mark.parametrize("scripted", [0, 1])
def test_a_stream_that_never_runs_ahead_generates_what_sync_generates(scripted) -> None:
    """max_staleness 0, two replicas: the same prompts, replicas and seeds as the sync loop's
    ``generate`` calls, so the same tokens, in the same order."""
    ours, theirs = [rollout(), rollout()], [rollout(), rollout()]
    s = stream(ours, scripted_rounds=scripted)
    s.start()
    try:
        for step in range(STEPS):
            taken = s.take(step)
            assert [g.position for g in taken.groups] == [step * PER_STEP + i for i in range(3)]
            # the sync loop: contiguous chunks per replica (2 prompts, then 1)
            prompts = [Prompt(token_ids=PROMPTS[i]) for i in step_prompts(step)]
            want = theirs[0].generate(prompts[:2], params(step))
            want += theirs[1].generate(prompts[2:], params(step))
            assert flatten(taken) == [(c.token_ids, c.log_probs) for c in want]
            for r in (*ours, *theirs):
                new_weights(r, step + 1)
            s.weights_at(step + 1)
    finally:
        s.close()


def test_partial_rollouts_resume_with_their_tokens_and_versions() -> None:
    """Requests aborted by a weight update continue under the new weights: every sample has
    its full length, tokens before the update carry version 0 and after it version 1."""
    r = rollout()
    s = stream([r], max_staleness=1, scripted_rounds=1)
    s.advance(2)  # steps 0 and 1 admitted (staleness 1); two tokens each
    r.pause_generation(abort=True)
    new_weights(r, 1)
    r.resume_generation()
    s.weights_at(1)
    first = s.take(1)
    second = s.take(1)
    for group in (*first.groups, *second.groups):
        for c in group.completions:
            assert c.token_versions[:2] == (0, 0), c
            assert set(c.token_versions[2:]) <= {1}
            assert len(c.token_ids) == 6 or c.finish_reason is FinishReason.STOP
    assert any(1 in c.token_versions for g in first.groups for c in g.completions)
    s.close()


def test_stale_groups_are_dropped_and_replaced() -> None:
    r = rollout()
    s = stream([r], max_staleness=1, scripted_rounds=1)
    s.advance(8)  # steps 0 and 1 generated under version 0
    for version in (1, 2):
        new_weights(r, version)
    s.weights_at(2)
    taken = s.take(2)  # the trainer is at 2: version-0 groups are 2 behind
    assert taken.dropped == 2 * PER_STEP
    assert all(g.oldest_version == 2 for g in taken.groups)
    assert [g.position for g in taken.groups] == [6, 7, 8]  # the next positions, in order
    # the dropped samples' lengths are reported (what dropping cost), once
    assert len(taken.dropped_lengths) == 2 * PER_STEP * N
    assert all(0 < length <= 6 for length in taken.dropped_lengths)
    stats = stream_stats(taken)
    assert stats["async/dropped_samples"] == 2 * PER_STEP * N
    assert stats["async/dropped_length_mean"] == sum(taken.dropped_lengths) / (2 * PER_STEP * N)
    assert s.take(2).dropped_lengths == ()
    s.close()


def _resumed_across_two_updates(**overrides) -> tuple[GroupStream, object]:
    """Steps 0 and 1 start under version 0 and are aborted and resumed under 1, then 2; the
    trainer takes at 3, when their first tokens are 3 versions old."""
    r = rollout()
    s = stream([r], max_staleness=1, scripted_rounds=1, **overrides)
    s.advance(2)
    for version in (1, 2):
        r.pause_generation(abort=True)
        new_weights(r, version)
        r.resume_generation()
        s.weights_at(version)
        s.advance(1)
    return s, s.take(3)


def test_staleness_from_the_last_token_keeps_answers_resumed_under_newer_weights() -> None:
    """The long answers are the ones resumed across updates: counted from their first token
    they are dropped, counted from the version they finished under they are trained."""
    s, by_first = _resumed_across_two_updates()
    s.close()
    assert by_first.dropped > 0
    assert all(g.oldest_version >= 2 for g in by_first.groups)
    s, by_last = _resumed_across_two_updates(stale_from_last_token=True)
    s.close()
    assert by_last.dropped < by_first.dropped
    kept = [g for g in by_last.groups if g.oldest_version == 0]
    assert kept and all(g.newest_version >= 2 for g in kept)
    # what is kept spans versions: its old tokens carry their version for the correction
    assert all(
        {0, 2} <= set(c.token_versions) for g in kept for c in g.completions if len(c.token_ids) > 3
    )


def test_kept_stale_groups_are_served_in_order() -> None:
    r = rollout()
    s = stream([r], max_staleness=1, drop_stale=False, scripted_rounds=1)
    s.advance(8)
    new_weights(r, 2)
    s.weights_at(2)
    taken = s.take(2)
    assert taken.dropped == 0 and [g.position for g in taken.groups] == [0, 1, 2]
    s.close()


class FailingRollout(FakeRollout):
    def poll(self, timeout_s: float = 0.0):
        if self.steps >= 2:
            raise ConnectionError("the rollout process died")
        return super().poll(timeout_s)


def test_a_failing_rollout_fails_the_next_take() -> None:
    s = stream([FailingRollout(FakeRolloutConfig(max_model_len=64))])
    s.start()
    with pytest.raises(GenerationError, match="ConnectionError: the rollout process died"):
        s.take(0)
    s.close()


def test_validation_generates_while_the_stream_is_suspended() -> None:
    """Inside ``suspended`` nothing of the stream runs and another caller polls the rollout;
    afterwards the stream's aborted requests resume and complete."""
    r = rollout()
    s = stream([r], max_staleness=1)
    s.start()
    try:
        with s.suspended():
            assert not r.requests._running
            greedy = SamplingParams(temperature=0.0, max_new_tokens=3)
            assert len(r.generate([Prompt(token_ids=(1,))], greedy)) == 1
        taken = s.take(0)
        assert all(len(g.completions) == N for g in taken.groups)
    finally:
        s.close()
    assert not r.requests._running and not r.requests._waiting  # nothing left behind


def test_taking_from_a_stream_nobody_drives_fails_at_once() -> None:
    s = stream([rollout()])  # no start(), not scripted: nothing would ever generate
    with pytest.raises(GenerationError, match="no generation thread is running"):
        s.take(0)


class CountingRollout(FakeRollout):
    """Records every poll's timeout."""

    def __init__(self, config: FakeRolloutConfig) -> None:
        super().__init__(config)
        self.polls: list[float] = []

    def poll(self, timeout_s: float = 0.0):
        self.polls.append(timeout_s)
        return super().poll(timeout_s)


def test_threads_never_wait_inside_a_poll_nor_poll_idle_or_paused_replicas_in_a_loop() -> None:
    """A remote rollout's poll that waits holds its channel, which a weight update needs; a
    replica whose admitted groups are all done waits on the stream, without polling; replicas
    paused for a weight update are polled with a backoff, not in a loop (one replica's empty
    poll must not wake the other's wait)."""
    rs = [CountingRollout(FakeRolloutConfig(max_model_len=64, seed=3)) for _ in range(2)]
    s = stream(rs)  # max_staleness 0: step 0's groups only, until new weights arrive
    s.start()
    try:
        s.take(0)
        polled = sum(len(r.polls) for r in rs)
        time.sleep(0.3)  # long enough for several polls if an idle replica were polled
        assert sum(len(r.polls) for r in rs) <= polled + 2
        for r in rs:
            r.pause_generation()
            new_weights(r, 1)
        s.weights_at(1)  # admits step 1 into paused rollouts: their polls find nothing
        polled = sum(len(r.polls) for r in rs)
        time.sleep(0.3)
        assert sum(len(r.polls) for r in rs) - polled <= 40  # backoff up to 50 ms each: ~14
        for r in rs:
            r.resume_generation()
        s.take(1)
    finally:
        s.close()
    assert all(r.polls and set(r.polls) == {0.0} for r in rs)  # close() had nothing to drain
