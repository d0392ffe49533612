"""The rollout conformance kit against the fake rollout, and against rollouts that break the
contract in one way each (the kit must notice)."""

import re
import time
from dataclasses import replace

import pytest

from drivetrain.api import Prompt
from drivetrain.api.rollout import FinishReason
from drivetrain.testing import FakeRollout, FakeRolloutConfig, fake_model
from drivetrain.testing.rollout_kit import (
    ROLLOUT_CHECKS,
    RolloutConformance,
    RolloutHarness,
    run_rollout_conformance,
)

VOCAB = 12


class FakeRolloutHarness(RolloutHarness):
    log_prob_tolerance = 1e-12
    deadline_s = 30.0

    def __init__(self, rollout_class: type[FakeRollout] = FakeRollout, **config) -> None:
        self.rollout_class = rollout_class
        self.config = FakeRolloutConfig(vocab_size=VOCAB, seed=1, **config)

    def make_rollout(self):
        return self.rollout_class(self.config)

    def prompts(self):
        return [(i % (VOCAB - 1) + 1, (3 * i) % (VOCAB - 1) + 1) for i in range(8)]

    def changed_weights(self):
        return list(fake_model.init_weights(VOCAB, seed=99, scale=2.0).items())

    def decode(self, token_ids):
        return fake_model.decode(token_ids)

    def eos_token_id(self):
        return fake_model.EOS_TOKEN_ID

    def reference_log_probs(self, prompt_ids, token_ids, temperature, changed):
        weights = (
            dict(self.changed_weights()) if changed else fake_model.init_weights(VOCAB, 1, 0.5)
        )
        scale = temperature or 1.0
        out, previous = [], prompt_ids[-1]
        for token in token_ids:
            logits = fake_model.next_token_logits(weights, previous)
            out.append(fake_model.log_softmax([x / scale for x in logits])[token])
            previous = token
        return out


class TestFakeRolloutConformance(RolloutConformance):
    def harness(self):
        return FakeRolloutHarness()


def test_a_small_batch_capacity_still_conforms():
    """Requests beyond the running capacity wait and join as others finish."""
    assert all(r.error is None for r in run_rollout_conformance(FakeRolloutHarness(max_batch=3)))


class NoVersion(FakeRollout):
    """Tags chunks with a stale version."""

    def update_weights(self, weights, *, version):
        super().update_weights(weights, version=0)


class AbortAsLength(FakeRollout):
    """An aborted request ends as if it had reached its length."""

    def poll(self, timeout_s: float = 0.0):
        from dataclasses import replace

        from drivetrain.api.rollout import FinishReason

        return [
            replace(c, finish_reason=FinishReason.LENGTH)
            if c.finish_reason is FinishReason.ABORT else c
            for c in super().poll(timeout_s)
        ]  # fmt: skip


class BatchDependent(FakeRollout):
    """Greedy picks the second-best token when more than one request runs."""

    def _step(self, joining, aborted):
        events = super()._step(joining, aborted)
        if len(events) > 1:
            for e in events:
                e.token_ids = [(e.token_ids[0] + 1) % VOCAB]
        return events


class PauseIgnored(FakeRollout):
    """Pausing holds nothing."""

    def pause_generation(self, *, abort=False):
        return 0


class TornSilently(FakeRollout):
    """Applies weights as they arrive and serves on after a stream broke half-way."""

    def update_weights(self, weights, *, version):
        with self.requests.lock:
            for name, value in weights:
                self.weights[name] = value
            self._version = version


class _Rewritten(FakeRollout):
    """Submits each request with its params rewritten by :meth:`rewrite`."""

    def rewrite(self, request):
        raise NotImplementedError

    def submit(self, requests):
        super().submit([replace(r, params=self.rewrite(r)) for r in requests])


class StopStringsIgnored(_Rewritten):
    def rewrite(self, request):
        return replace(request.params, stop=())


class MaxNewTokensIgnored(_Rewritten):
    """Generates up to the context instead."""

    def rewrite(self, request):
        room = self.config.max_model_len - len(request.prompt_ids)
        return replace(request.params, max_new_tokens=room)


class TopPIgnored(_Rewritten):
    def rewrite(self, request):
        return replace(request.params, top_p=1.0)


class LogProbsOff(FakeRollout):
    """Reports every log-prob 0.01 too low."""

    def poll(self, timeout_s: float = 0.0):
        return [
            replace(c, log_probs=tuple(x - 0.01 for x in c.log_probs))
            for c in super().poll(timeout_s)
        ]


class Buffered(FakeRollout):
    """Holds a request's tokens until it ends, and drops them when it is aborted."""

    def __init__(self, config):
        super().__init__(config)
        self.held = {}

    def poll(self, timeout_s: float = 0.0):
        out = []
        for c in super().poll(timeout_s):
            self.held.setdefault(c.request_id, []).append(c)
            if c.finished:
                chunks = self.held.pop(c.request_id)
                if c.finish_reason is FinishReason.ABORT:
                    out.append(replace(c, token_ids=(), log_probs=()))
                else:
                    tokens = sum((x.token_ids for x in chunks), ())
                    log_probs = sum((x.log_probs for x in chunks), ())
                    out.append(replace(c, token_ids=tokens, log_probs=log_probs))
        return out


#: the planted bugs of issue 35 and what the kit must say of each: the rollout, the check
#: that catches it, and its message
PLANTED = [
    (NoVersion, "weight_versions", "weight_version is 0 after update 7"),
    (NoVersion, "updates_between_steps", "weight_version is 0 after update 1"),
    (Buffered, "abort", "streamed no tokens before it ended"),
    (LogProbsOff, "greedy_determinism", "differ from the reference forward by 0.01"),
    (StopStringsIgnored, "stop_conditions", "stop string .* ran past it, .*: it is ignored"),
    (MaxNewTokensIgnored, "stop_conditions", "max_new_tokens=1 gave .*: max_new_tokens is ignored"),
    (TopPIgnored, "sampling_filters", "top_p=0.001 at temperature 1 sampled .*: top_p is ignored"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("broken", "check", "message"), PLANTED)
def test_the_whole_kit_names_a_planted_bug_within_a_minute(broken, check, message):
    """At the default deadline (300 s) no check waits for what already went wrong."""
    harness = FakeRolloutHarness(broken)
    harness.deadline_s = RolloutHarness.deadline_s
    began = time.monotonic()
    errors = {r.name: r.error for r in run_rollout_conformance(harness)}
    assert time.monotonic() - began < 60
    assert errors[check] is not None and re.search(message, errors[check]), errors


@pytest.mark.parametrize(
    ("broken", "check", "message"),
    [
        (NoVersion, "weight_versions", "weight_version is 0 after update 7"),
        (AbortAsLength, "abort", "was aborted but ended with FinishReason.LENGTH"),
        (BatchDependent, "greedy_determinism", "greedy tokens depend on the batch"),
        (PauseIgnored, "abort", "a paused rollout generated"),
        (TornSilently, "failed_update", "generated from other weights than version 0"),
    ],
)
def test_the_kit_catches_a_broken_rollout(broken, check, message):
    with pytest.raises(AssertionError, match=message):
        ROLLOUT_CHECKS[check](FakeRolloutHarness(broken))


def test_a_failing_step_ends_every_request_and_the_rollout_serves_again():
    """A backend step that raises: the error reaches the poller, every request it held ends
    with abort at the next poll, and new requests run."""
    from drivetrain.api.requests import Request
    from drivetrain.api.rollout import FinishReason, SamplingParams
    from drivetrain.runtime.collector import Collector

    class Flaky(FakeRollout):
        fail = True

        def _step(self, joining, aborted):
            events = super()._step(joining, aborted)
            if self.fail and self.steps == 3:
                self.fail = False
                raise RuntimeError("device lost")
            return events

    rollout = Flaky(FakeRolloutConfig(vocab_size=VOCAB))
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    requests = [Request(f"r{i}", (1 + i,), params) for i in range(3)]
    collector = Collector()
    for r in requests:
        collector.track(r)
    rollout.submit(requests)
    with pytest.raises(RuntimeError, match="device lost"):
        while True:
            collector.add(rollout.poll())
    collector.add(rollout.poll())
    assert collector.done
    assert {c.finish_reason for c in collector.completions()} == {FinishReason.ABORT}
    assert not rollout._running  # the backend dropped its batch
    again = rollout.generate([Prompt(token_ids=(2,))], params)
    assert len(again[0].token_ids) == 8


def test_an_unknown_chunk_or_a_chunk_after_the_end_is_refused():
    from drivetrain.api.requests import Chunk, Request
    from drivetrain.api.rollout import FinishReason, SamplingParams
    from drivetrain.runtime.collector import Collector

    collector = Collector()
    collector.track(Request("a", (1,), SamplingParams()))
    with pytest.raises(ValueError, match="unknown request 'b'"):
        collector.add([Chunk("b", (), (), 0)])
    collector.add([Chunk("a", (2,), (-0.5,), 0, FinishReason.STOP)])
    with pytest.raises(ValueError, match="after it finished"):
        collector.add([Chunk("a", (3,), (-0.5,), 0)])


def test_pop_returns_a_resumed_sequence_whole_and_forgets_every_segment():
    from drivetrain.api.requests import Chunk, Request
    from drivetrain.api.rollout import FinishReason, SamplingParams
    from drivetrain.runtime.collector import Collector

    collector = Collector()
    collector.track(Request("a", (1,), SamplingParams(max_new_tokens=4)))
    collector.add([Chunk("a", (2,), (-0.5,), 0, FinishReason.ABORT)])
    resumed = collector.resume("a", "a+1")
    assert resumed.prompt_ids == (1, 2) and resumed.params.max_new_tokens == 3
    assert collector.add([Chunk("a+1", (3,), (-0.25,), 1, FinishReason.STOP)]) == ["a"]
    done = collector.pop("a+1")
    assert done.token_ids == (2, 3) and done.token_versions == (0, 1)
    assert collector.completions() == []
    collector.track(Request("a", (5,), SamplingParams()))  # its ids are free again
    collector.track(Request("a+1", (5,), SamplingParams()))
