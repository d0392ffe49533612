"""The rollout conformance kit on the ``hf`` rollout (continuous batching), in this process
and behind a rollout server process; and 64 streaming requests, half of them aborted."""

import random

import pytest
import torch

from drivetrain.api import FinishReason, SamplingParams
from drivetrain.api.registry import rollouts
from drivetrain.api.requests import Collector, Request
from drivetrain.api.testing.rollout_kit import RolloutConformance
from drivetrain.rollout.config import HFRolloutConfig
from rollout_support import TransformersRolloutHarness, build_model, this_python

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("hf-kit") / "model")


def hf(model_dir, **overrides):
    config = HFRolloutConfig(model_path=str(model_dir), max_model_len=256, **overrides)
    return rollouts.load("hf")(config)


class TestHFRollout(RolloutConformance):
    @pytest.fixture(autouse=True)
    def _model(self, model_dir):
        self.model_dir = model_dir

    def harness(self):
        return TransformersRolloutHarness(self.model_dir, lambda: hf(self.model_dir))


class TestHFRolloutSmallBatch(TestHFRollout):
    """Four rows at most: requests wait for a free row and join a running batch."""

    def harness(self):
        return TransformersRolloutHarness(
            self.model_dir, lambda: hf(self.model_dir, max_batch_size=4)
        )


def test_the_kit_passes_through_a_rollout_server_process(model_dir):
    from drivetrain.api.testing.rollout_kit import run_rollout_conformance

    harness = TransformersRolloutHarness(model_dir, lambda: hf(model_dir, python=this_python()))
    failed = [r for r in run_rollout_conformance(harness) if r.error is not None]
    assert not failed, failed


def test_64_streaming_requests_half_aborted(model_dir):
    """Aborted requests return their partial tokens and log-probs with finish reason abort;
    the others equal an undisturbed greedy run bitwise."""
    harness = TransformersRolloutHarness(model_dir, lambda: hf(model_dir))
    rng = random.Random(0)
    vocab = 90
    prompts = [tuple(rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))) for _ in range(64)]
    greedy = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)

    def run(prefix, abort_at):
        rollout = hf(model_dir)
        collector = Collector()
        requests = [Request(f"{prefix}{i}", p, greedy, i) for i, p in enumerate(prompts)]
        for r in requests:
            collector.track(r)
        rollout.submit(requests[:32])  # the rest join a running batch
        seen = dict.fromkeys(abort_at, 0)
        polls = 0
        while not collector.done:
            chunks = rollout.poll(0.05)
            collector.add(chunks)
            polls += 1
            if polls == 3:
                rollout.submit(requests[32:])
            for c in chunks:
                if c.request_id in seen and not c.finished:
                    seen[c.request_id] += len(c.token_ids)
                    if seen[c.request_id] >= abort_at[c.request_id]:
                        rollout.abort([c.request_id])
                        del seen[c.request_id]
        rollout.shutdown()
        return collector.completions()

    undisturbed = run("u", {})
    abort_at = {f"a{i}": rng.randint(1, 30) for i in rng.sample(range(64), 32)}
    disturbed = run("a", abort_at)
    for i, (ours, theirs) in enumerate(zip(disturbed, undisturbed, strict=True)):
        if f"a{i}" in abort_at:
            assert ours.finish_reason is FinishReason.ABORT
            n = len(ours.token_ids)
            assert n >= abort_at[f"a{i}"] and ours.token_ids == theirs.token_ids[:n]
            assert len(ours.log_probs) == n
            reference = harness.reference_log_probs(ours.prompt_ids, ours.token_ids, 0, False)
            assert max(abs(a - b) for a, b in zip(ours.log_probs, reference, strict=True)) < 1e-4
        else:
            assert ours.finish_reason is FinishReason.LENGTH
            assert ours.token_ids == theirs.token_ids  # bitwise, whatever ran beside it
