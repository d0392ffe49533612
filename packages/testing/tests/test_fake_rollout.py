import math

import pytest

from drivetrain.api import FinishReason, Prompt, SamplingParams
from drivetrain.testing import (
    FakeEngine,
    FakeEngineConfig,
    FakeRollout,
    FakeRolloutConfig,
    fake_model,
)
from drivetrain.testing.fake_rollout import processed_log_probs


def rollout(**kw):
    return FakeRollout(FakeRolloutConfig(vocab_size=8, max_model_len=32, **kw))


def test_generate_groups_n_samples_per_prompt_in_order():
    prompts = [Prompt(token_ids=(1, 2)), Prompt(token_ids=(3,))]
    out = rollout().generate(prompts, SamplingParams(n=3, max_new_tokens=5, seed=1))
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1]
    for c in out:
        assert len(c.token_ids) == len(c.log_probs) <= 5
        assert all(lp <= 0 for lp in c.log_probs)
        assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert c.weight_version == 0


def test_greedy_and_seeded_sampling_are_reproducible():
    prompts = [Prompt(token_ids=(1,))]
    r = rollout()
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    assert r.generate(prompts, greedy) == r.generate(prompts, greedy)
    # greedy reports the unscaled distribution's log-prob of its argmax, like vLLM
    first = r.generate(prompts, greedy)[0]
    logits = fake_model.next_token_logits(r.weights, 1)
    assert first.token_ids[0] == max(range(len(logits)), key=logits.__getitem__)
    assert first.log_probs[0] == pytest.approx(max(fake_model.log_softmax(logits)))
    sampled = SamplingParams(max_new_tokens=6, seed=7)
    assert r.generate(prompts, sampled) == r.generate(prompts, sampled)


def test_processed_log_probs_renormalise_after_top_k():
    logp = processed_log_probs([0.0, 1.0, 2.0, 3.0], SamplingParams(top_k=2, temperature=0.5))
    assert logp[0] == logp[1] == -math.inf
    assert math.isclose(sum(math.exp(x) for x in logp if x > -math.inf), 1.0)


def test_update_weights_from_engine_stream_changes_generation_and_version():
    engine = FakeEngine(FakeEngineConfig(vocab_size=8, seed=3))
    engine.initialize()
    r = rollout()
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    r.update_weights(engine.export_weights(), version=5)
    fresh = rollout(seed=3)
    prompts = [Prompt(token_ids=(2,))]
    assert [c.token_ids for c in r.generate(prompts, params)] == [
        c.token_ids for c in fresh.generate(prompts, params)
    ]
    assert r.weight_version == 5


def test_an_update_that_fails_part_way_leaves_the_rollout_refusing_until_a_whole_one():
    """Weights are applied as they arrive: a bad name after a good one leaves a mix, so the
    rollout refuses requests until a whole update lands; a bad first name changes nothing."""
    r = rollout()
    prompts = [Prompt(token_ids=(2,))]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    with pytest.raises(KeyError, match="unknown weight 'nope'"):
        r.update_weights([("nope", [1.0])], version=1)
    assert r.torn is None and r.generate(prompts, params)
    with pytest.raises(KeyError, match="unknown weight 'nope'"):
        r.update_weights([("bigram.bias", [9.0] * 8), ("nope", [1.0])], version=1)
    assert r.weight_version == 0
    with pytest.raises(RuntimeError, match="update to weights version 1 failed part-way"):
        r.generate(prompts, params)
    r.update_weights([("bigram.bias", [9.0] * 8)], version=2)
    assert r.weight_version == 2 and r.generate(prompts, params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"n": 0}, "n=0"), ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature")],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context_is_rejected():
    with pytest.raises(ValueError, match="exceed max_model_len"):
        rollout().generate([Prompt(token_ids=(1,) * 30)], SamplingParams(max_new_tokens=8))


def test_sleep_reports_nothing_freed():
    r = rollout()
    assert r.sleep(1) is False
    with pytest.raises(RuntimeError, match="asleep"):
        r.generate([Prompt(token_ids=(1,))], SamplingParams())
    r.wake_up()
    assert r.generate([Prompt(token_ids=(1,))], SamplingParams(max_new_tokens=1))
