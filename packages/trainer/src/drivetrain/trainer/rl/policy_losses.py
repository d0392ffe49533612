"""Policy-gradient losses, registered by name (``algorithm.policy_loss``).

Each takes :class:`PolicyLossInputs` (per-token tensors of one micro-batch, padded ``[b, T]`` or
packed ``[tokens]``) and :class:`ClipConfig`, and returns the per-token loss and per-token
indicator metrics (e.g. ``clip_frac``); the actor loss aggregates both over the mini-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from drivetrain.trainer.named_registry import NamedRegistry
from drivetrain.trainer.rl.aggregation import expand_sequences, sequence_means


@dataclass(frozen=True)
class ClipConfig:
    """``algorithm.clip``: the importance ratio is clipped to ``[1 - low, 1 + high]``."""

    low: float = 0.2
    high: float = 0.2  # > low: DAPO's "clip-higher"
    dual: float = 3.0  # dual-clip bound c for negative advantages (> 1); 0 disables

    def __getattr__(self, name: str) -> float:
        # only for names that are not fields: a policy loss written for the old field names
        # fails saying what to read instead
        if name in _OLD_CLIP_FIELDS:
            raise AttributeError(
                f"ClipConfig.{name} is now ClipConfig.{_OLD_CLIP_FIELDS[name]} "
                "(algorithm.clip.low/high/dual)"
            )
        raise AttributeError(name)


_OLD_CLIP_FIELDS = {"clip_low": "low", "clip_high": "high", "dual_clip": "dual"}


@dataclass(frozen=True)
class PolicyLossInputs:
    log_probs: torch.Tensor  # current policy, with gradient
    old_log_probs: torch.Tensor  # the policy that sampled (recomputed by the actor)
    advantages: torch.Tensor
    mask: torch.Tensor
    seq_lens: Sequence[int]


PolicyLossResult = tuple[torch.Tensor, Mapping[str, torch.Tensor]]
PolicyLoss = Callable[[PolicyLossInputs, ClipConfig], PolicyLossResult]
POLICY_LOSSES: NamedRegistry[PolicyLoss] = NamedRegistry("policy loss")


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, clip: ClipConfig
) -> PolicyLossResult:
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip.low, 1.0 + clip.high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_frac": (clipped > unclipped).float()}
    if clip.dual > 0:
        # a negative advantage with a huge ratio would push without bound: cap at -A·c
        bound = -adv * clip.dual
        dual = torch.minimum(loss, bound)
        metrics["dual_clip_frac"] = ((adv < 0) & (loss > bound)).float()
        loss = torch.where(adv < 0, dual, loss)
    return loss, metrics


@POLICY_LOSSES.register("vanilla")
def ppo_clip_loss(inputs: PolicyLossInputs, clip: ClipConfig) -> PolicyLossResult:
    """PPO's clipped surrogate per token, with dual-clip for negative advantages."""
    log_ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-20.0, 20.0)
    return _clipped_surrogate(log_ratio.exp(), inputs.advantages, clip)


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(inputs: PolicyLossInputs, clip: ClipConfig) -> PolicyLossResult:
    """Plain policy gradient ``-A · ratio`` (on-policy its gradient is ``-A ∇log π``)."""
    ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-20.0, 20.0).exp()
    return -inputs.advantages * ratio, {}


@POLICY_LOSSES.register("cispo")
def cispo_loss(inputs: PolicyLossInputs, clip: ClipConfig) -> PolicyLossResult:
    """CISPO (MiniMax-M1): ``-sg(min(ratio, 1 + clip.high)) · A · log π``. The importance
    weight is clipped and detached instead of the update: every token keeps a gradient (PPO's
    clip zeroes the clipped tokens', which are often the rare reasoning tokens). No lower
    bound, as the paper recommends; TRL's ``epsilon_high=5.0`` is ``clip.high=4.0`` here."""
    ratio = (inputs.log_probs - inputs.old_log_probs).clamp(-20.0, 20.0).exp().detach()
    weight = ratio.clamp(max=1.0 + clip.high)
    loss = -weight * inputs.advantages * inputs.log_probs
    return loss, {"clip_frac": (ratio > 1.0 + clip.high).float()}


@POLICY_LOSSES.register("gspo")
def gspo_loss(inputs: PolicyLossInputs, clip: ClipConfig) -> PolicyLossResult:
    """GSPO: one importance ratio per sequence, ``exp(mean_t log π/π_old)``, clipped like
    PPO's; each token carries the sequence ratio with its own gradient path
    (``s_i · π_t / sg(π_t)``). Use small clip ranges (the paper: 3e-4 / 4e-4)."""
    delta = inputs.log_probs - inputs.old_log_probs
    seq_log_ratio = sequence_means(delta, inputs.mask, inputs.seq_lens)
    per_seq = expand_sequences(seq_log_ratio.detach(), inputs.log_probs, inputs.seq_lens)
    token_log_ratio = per_seq + inputs.log_probs - inputs.log_probs.detach()
    ratio = token_log_ratio.clamp(max=10.0).exp()
    return _clipped_surrogate(ratio, inputs.advantages, replace(clip, dual=0.0))
