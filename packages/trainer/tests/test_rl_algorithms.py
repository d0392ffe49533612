"""CISPO, REINFORCE++, DAPO's sampling pieces and the named presets, against values computed
by hand."""

from __future__ import annotations

import math

import pytest
import torch

from drivetrain.api import Batch, Completion, FinishReason
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.rl.advantages import ADVANTAGES, AdvantageInputs
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.dapo import dynamic_sample, filter_truncated, overlong_penalty
from drivetrain.trainer.rl.job import preset_files, preset_names
from drivetrain.trainer.rl.policy_losses import POLICY_LOSSES, ClipConfig, PolicyLossInputs
from drivetrain.trainer.rl.prompts import PromptSampler
from drivetrain.trainer.rl.sample_groups import SampledGroup, join_groups, split_groups


def test_cispo_clips_the_detached_weight_and_keeps_every_gradient() -> None:
    # ratios 0.5, 1.0, 3.0 and 8.0 against a cap of 1 + 4 = 5
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([0.5, 1.0, 3.0, 8.0])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    inputs = PolicyLossInputs(logp, old, adv, torch.ones(4), [4])
    loss, metrics = POLICY_LOSSES.get("cispo")(inputs, ClipConfig(0.2, 4.0, 0.0))
    weights = [0.5, 1.0, 3.0, 5.0]
    want = [-w * a * lp for w, a, lp in zip(weights, adv.tolist(), logp.tolist(), strict=True)]
    assert loss.tolist() == pytest.approx(want)
    assert metrics["clip_frac"].tolist() == [0.0, 0.0, 0.0, 1.0]
    loss.sum().backward()
    # d/dlogp of -sg(w) A logp is -w A: the clipped token still has a gradient (PPO's has 0)
    assert logp.grad.tolist() == pytest.approx([-0.5, 1.0, -6.0, -5.0])


def test_reinforce_pp_returns_whitened_over_the_batch() -> None:
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([[0, 0.5, 1.0], [0, 0.0, 0.0]], dtype=torch.float64)
    adv, returns = ADVANTAGES.get("reinforce_pp")(AdvantageInputs(rewards, mask, [0, 1], gamma=0.5))
    # G: sample 0: t2 = 1, t1 = 0.5 + 0.5 * 1 = 1; sample 1: 0, 0
    assert returns.flatten().tolist() == pytest.approx([0, 1, 1, 0, 0, 0])
    # whitened over the 4 response tokens: mean 0.5, unbiased var 1/3
    z = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert adv.flatten().tolist() == pytest.approx([0, z, z, 0, -z, -z])


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens() -> None:
    mask = torch.ones(4, 1, dtype=torch.float64)
    rewards = torch.tensor([[1.0], [0.0], [3.0], [3.0]], dtype=torch.float64)
    adv, centred = ADVANTAGES.get("reinforce_pp_baseline")(
        AdvantageInputs(rewards, mask, [0, 0, 1, 1])
    )
    assert centred[:, 0].tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0])
    # mean 0, unbiased var (0.25 + 0.25) / 3; no per-group std division
    scale = 1 / math.sqrt(0.5 / 3 + 1e-8)
    assert adv[:, 0].tolist() == pytest.approx([0.5 * scale, -0.5 * scale, 0.0, 0.0])


def test_reinforce_pp_baseline_keeps_a_per_token_kl_per_token() -> None:
    # one group of two; token rewards: a KL penalty on every response token, score at the end
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([[0, -0.1, 1.0 - 0.1], [0, -0.2, -0.2]], dtype=torch.float64)
    _, returns = ADVANTAGES.get("reinforce_pp_baseline")(
        AdvantageInputs(rewards, mask, [0, 0], gamma=1.0)
    )
    mean = (0.8 + -0.4) / 2  # the group's mean total
    assert returns.flatten().tolist() == pytest.approx(
        [0, -0.1 + 0.9 - mean, 0.9 - mean, 0, -0.4 - mean, -0.2 - mean]
    )


def test_overlong_penalty_is_dapos_linear_ramp() -> None:
    # L_max 10, buffer 0.2: L_cache 2, ramp from 8 tokens to -1 at 10
    got = overlong_penalty([3, 8, 9, 10], 10, 0.2, 1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0])
    assert overlong_penalty([9], 10, 0.2, 0.5).tolist() == pytest.approx([-0.25])


def _completion(prompt: int, tokens: int = 2, finish: FinishReason = FinishReason.STOP):
    return Completion(prompt, (1,), (5,) * tokens, (-0.1,) * tokens, finish, 0)


def _groups(prompts: list[str], scores: list[list[float]]) -> list[SampledGroup]:
    completions = [_completion(p) for p, group in enumerate(scores) for _ in group]
    flat = torch.tensor([s for group in scores for s in group])
    return split_groups(prompts, completions, flat, {"exact_match": flat.tolist()})


def test_dynamic_sampling_keeps_informative_groups_until_enough() -> None:
    first = _groups(["a", "b", "c"], [[1, 1], [0, 1], [0, 0]])  # only b informative
    rounds = {1: _groups(["d", "e", "f"], [[1, 0], [1, 1], [0.5, 0]])}
    calls = []

    def more(round_: int, prompts: int) -> list[SampledGroup]:
        calls.append((round_, prompts))
        return rounds[round_]

    sample = dynamic_sample(first, more, wanted=3, max_rounds=4)
    assert [g.prompt for g in sample.kept] == ["b", "d", "f"]
    # 2 groups missing at 1 informative in 3: min(3, ceil(2 * 3)) prompts asked for
    assert calls == [(1, 3)] and sample.rounds == 2
    assert sample.metrics() == {
        "sampling/rounds": 2.0,
        "sampling/generated_groups": 6.0,
        "sampling/generated_samples": 12.0,
        "sampling/generated_tokens": 24.0,  # two tokens each
        "sampling/zero_variance_frac": 3 / 6,
        "sampling/kept_groups": 3.0,
    }
    prompts, completions, scores, parts = join_groups(sample.kept)
    assert prompts == ["b", "d", "f"]
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2]
    assert scores.tolist() == [0, 1, 1, 0, 0.5, 0]
    assert parts["exact_match"] == scores.tolist()


def test_informative_means_the_verifier_disagrees_not_the_length_shaping() -> None:
    completions = [_completion(0), _completion(0)]
    scores = torch.tensor([1.0 - 0.5, 1.0])  # same verdict, one answer in the overlong ramp
    parts = {"exact_match": [1.0, 1.0], "overlong": [-0.5, 0.0]}
    (group,) = split_groups(["a"], completions, scores, parts)
    assert not group.informative


def test_dynamic_sampling_stops_at_the_round_cap() -> None:
    first = _groups(["a", "b"], [[1, 1], [0, 1]])
    sample = dynamic_sample(first, lambda r, n: _groups(["x", "y"], [[0, 0], [1, 1]]), 2, 3)
    assert [g.prompt for g in sample.kept] == ["b"] and sample.rounds == 3
    # nothing informative at all: the first round trains (no policy gradient, as GRPO's)
    none = dynamic_sample(first[:1], lambda r, n: first[:1], 2, 2)
    assert [g.prompt for g in none.kept] == ["a"]


def test_overlong_filter_zeroes_truncated_samples_loss() -> None:
    completions = [_completion(0), _completion(0, finish=FinishReason.LENGTH)]
    batch = Batch.from_columns({"loss_mask": torch.tensor([[0, 1, 1], [0, 1, 1]])}, seq_lens=[3, 3])
    filtered, frac = filter_truncated(batch, completions)
    assert filtered["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]] and frac == 0.5
    every = [_completion(0, finish=FinishReason.LENGTH)] * 2
    kept, frac = filter_truncated(batch, every)
    assert kept["loss_mask"].tolist() == batch["loss_mask"].tolist() and frac == 1.0


def test_extra_prompts_avoid_the_step_and_each_other() -> None:
    sampler = PromptSampler(10, 3, seed=1)
    first, second = sampler.extra(2, 0, 3), sampler.extra(2, 3, 4)
    assert len(first) == 3 and not set(first) & set(sampler.indices(2))
    assert not set(first) & set(second) and len(second) == 4  # rounds never repeat
    assert PromptSampler(10, 3, seed=1).extra(2, 0, 3) == first  # a function of seed, step
    assert sampler.extra(3, 0, 3) != first


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "bnpo", "dapo", "cispo", "reinforce_pp"])
def test_presets_load_and_user_overrides_win(name: str) -> None:
    assert name in preset_names()
    config = load_config(RLConfig, files=preset_files(name), overrides=["algorithm.clip.low=0.1"])
    assert config.algorithm.clip.low == 0.1


def test_preset_values() -> None:
    dapo = load_config(RLConfig, files=preset_files("dapo")).algorithm
    assert (dapo.clip.high, dapo.dapo.dynamic_sampling, dapo.dapo.overlong_buffer) == (
        0.28,
        True,
        0.2,
    )
    dr = load_config(RLConfig, files=preset_files("dr_grpo")).algorithm
    assert (dr.norm_by_std, dr.aggregation) == (False, "seq-mean-token-sum-norm")
    with pytest.raises(ConfigError, match="unknown preset 'dapoo'; known: bnpo, cispo"):
        preset_files("dapoo")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.dapo.dynamic_sampling=true", "algorithm.mode=async"], "algorithm.mode=sync,"),
        (["algorithm.dapo.dynamic_sampling=true", "sampling.n=1"], "needs sampling.n >= 2"),
        (["algorithm.dapo.overlong_buffer=1.5"], "overlong_buffer must be in"),
        (["algorithm.dapo.max_sampling_rounds=0"], "max_sampling_rounds must be >= 1"),
    ],
)
def test_dapo_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(RLConfig, overrides=overrides)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_pp"])
def test_observation_tokens_between_turns_are_not_steps(estimator) -> None:
    """A two-turn episode (prompt, turn 1, observation, turn 2, padding) gets the advantages
    of the same turns without the observation between them: the first turn bootstraps from
    the second's value (GAE) and is credited the final reward, discounted per sampled token."""
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]], dtype=torch.float64)
    rewards = torch.tensor([[0, 0, 0.5, 0, 0, 0, 1.0, 0]], dtype=torch.float64)
    values = torch.tensor([[9, 0.1, 0.2, 9, 9, 0.3, 0.4, 9]], dtype=torch.float64)
    keep = mask[0].bool()
    compact = AdvantageInputs(
        rewards[:, keep], mask[:, keep], [0], values=values[:, keep], gamma=0.9, lam=0.8
    )
    spread = AdvantageInputs(rewards, mask, [0], values=values, gamma=0.9, lam=0.8)
    want_adv, want_ret = ADVANTAGES.get(estimator)(compact)
    adv, ret = ADVANTAGES.get(estimator)(spread)
    assert torch.allclose(adv[:, keep], want_adv) and torch.allclose(ret[:, keep], want_ret)
    assert not adv[:, ~keep].any() and not ret[:, ~keep].any()
