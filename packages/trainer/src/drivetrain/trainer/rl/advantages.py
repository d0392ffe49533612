"""Advantage estimators, registered by name (``algorithm.advantage``).

Every estimator takes an :class:`AdvantageInputs` of padded ``[B, T]`` tensors on the
controller (the sequence's tokens, prompt then response; ``mask`` is 1 on response tokens) and
returns ``(advantages, returns)``, both ``[B, T]`` and zero outside the mask. ``returns`` is
what a critic regresses onto (estimators without a critic return the advantages).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drivetrain.trainer.named_registry import NamedRegistry


@dataclass(frozen=True)
class AdvantageInputs:
    token_rewards: torch.Tensor  # [B, T]: the sequence reward on its last response token, minus
    #                              the per-token KL penalty when the KL is in the reward
    mask: torch.Tensor  # [B, T] float: response tokens
    group_ids: Sequence[int]  # samples of the same prompt share an id
    values: torch.Tensor | None = None  # [B, T] critic's V(state before token t); needs a critic
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True
    eps: float = 1e-6


Estimator = Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor]]
ADVANTAGES: NamedRegistry[Estimator] = NamedRegistry("advantage estimator")
#: Estimators that need ``values`` (the trainer then runs a critic).
NEEDS_CRITIC = {"gae"}
#: Estimators whose baseline is the prompt's group (its other samples' mean): a group of one
#: sample has none (grpo, reinforce_pp_baseline: plain REINFORCE; rloo: advantage 0), so they
#: need ``sampling.n >= 2`` (a plugin's group-relative estimator adds its name here)
NEEDS_GROUPS = {"grpo", "rloo", "reinforce_pp_baseline"}
#: what to use instead with one sample per prompt: estimators with a baseline of their own
OWN_BASELINE = {"gae": "a critic, as `drivetrain ppo`", "reinforce_pp": "batch-whitened returns"}


def _group_index(group_ids: Sequence[int]) -> torch.Tensor:
    _, index = torch.unique(torch.as_tensor(list(group_ids)), return_inverse=True)
    return index


def _group_mean_std(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-sample mean and (unbiased) std of its group; a group of one has mean 0, std 1."""
    groups = int(index.max()) + 1 if len(index) else 0
    count = torch.zeros(groups, dtype=scores.dtype).index_add(0, index, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=scores.dtype).index_add(0, index, scores)
    mean = total / count
    sq = torch.zeros(groups, dtype=scores.dtype).index_add(0, index, (scores - mean[index]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    single = count[index] < 2
    return (
        torch.where(single, torch.zeros_like(scores), mean[index]),
        torch.where(single, torch.ones_like(scores), std[index]),
    )


@ADVANTAGES.register("grpo")
def grpo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative: ``(score - mean of the prompt's samples) / (std + eps)`` (the division
    only with ``norm_by_std``), the same value on every response token."""
    scores = (inputs.token_rewards * inputs.mask).sum(dim=-1)
    mean, std = _group_mean_std(scores, _group_index(inputs.group_ids))
    adv = scores - mean
    if inputs.norm_by_std:
        adv = adv / (std + inputs.eps)
    adv = adv[:, None] * inputs.mask
    return adv, adv


@ADVANTAGES.register("rloo")
def rloo_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out: ``score - mean of the *other* samples of the prompt``."""
    scores = (inputs.token_rewards * inputs.mask).sum(dim=-1)
    index = _group_index(inputs.group_ids)
    groups = int(index.max()) + 1
    count = torch.zeros(groups, dtype=scores.dtype).index_add(0, index, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=scores.dtype).index_add(0, index, scores)
    n = count[index]
    others = torch.where(n > 1, (total[index] - scores) / (n - 1).clamp(min=1), scores)
    adv = (scores - others)[:, None] * inputs.mask
    return adv, adv


def _discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = sum_k gamma^(k-t) r_k`` over each row's response tokens (``k`` counting those
    only: a multi-turn episode's observation tokens between turns are not steps), zero outside
    ``mask``."""
    rewards = rewards * mask
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * mask


@ADVANTAGES.register("reinforce_pp")
def reinforce_pp_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: each token's discounted return ``G_t = sum_k gamma^(k-t) r_k`` (a KL in the
    reward makes it differ per token), normalised over every response token of the *batch*
    (no per-prompt baseline: the batch statistics stand in for a critic)."""
    returns = _discounted_returns(inputs.token_rewards, inputs.mask, inputs.gamma)
    return masked_whiten(returns, inputs.mask), returns


@ADVANTAGES.register("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    inputs: AdvantageInputs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: the prompt group's mean reward subtracted on each sample's last
    response token (no division by the group's std), then REINFORCE++'s per-token discounted
    returns (a KL in the reward stays per token), normalised over every response token of the
    batch."""
    mask = inputs.mask
    scores = (inputs.token_rewards * mask).sum(dim=-1)
    mean, _ = _group_mean_std(scores, _group_index(inputs.group_ids))
    last = mask.shape[1] - 1 - mask.flip(-1).argmax(dim=-1)  # each row's last response token
    rewards = inputs.token_rewards.clone()
    rewards[torch.arange(len(rewards)), last] -= mean
    returns = _discounted_returns(rewards, mask, inputs.gamma)
    return masked_whiten(returns, mask), returns


@ADVANTAGES.register("distill")
def distill_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: each token's own reward is its advantage (no discount, no
    baseline): with a teacher, ``-coef x (log pi_student - log pi_teacher)`` of that token
    (plus the sequence reward on the last token, when the reward functions weigh anything).
    The per-token reverse-KL signal of GKD / on-policy distillation."""
    adv = inputs.token_rewards * inputs.mask
    return adv, adv


@ADVANTAGES.register("gae")
def gae_advantages(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens:
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, returns
    ``A + V``; advantages whitened over the batch's response tokens (PPO's usual normalisation).
    ``t + 1`` is the next *response* token: in a multi-turn episode a turn's last token
    bootstraps from the next turn's first, across the observation tokens between them (not
    steps of the policy); after the last response token it is 0."""
    if inputs.values is None:
        raise ValueError("GAE needs the critic's values")
    mask = inputs.mask
    values = inputs.values * mask
    rewards = inputs.token_rewards * mask
    last = torch.zeros(values.shape[0], dtype=values.dtype)
    next_value = torch.zeros_like(last)
    adv = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        response = mask[:, t] > 0
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        # a prompt, observation or padding position passes everything through unchanged
        last = torch.where(response, delta + inputs.gamma * inputs.lam * last, last)
        next_value = torch.where(response, values[:, t], next_value)
        adv[:, t] = last * mask[:, t]
    returns = (adv + values) * mask
    return masked_whiten(adv, mask), returns


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) * mask) ** 2).sum() / (n - 1).clamp(min=1)
    return (values - mean) * torch.rsqrt(var + eps) * mask
