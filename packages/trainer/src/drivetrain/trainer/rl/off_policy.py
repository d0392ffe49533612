"""Off-policy corrections, registered by name (``algorithm.correction``).

The rollout sampled each token under a *behaviour* policy ``μ`` (its own log-probs: an older
weight version in async modes, and a different numeric stack everywhere); the trainer's loss
takes the PPO ratio against the *proximal* policy ``π_old``, its own log-probs of the batch
before this update. A correction turns the per-token gap ``r_t = π_old(y_t) / μ(y_t)`` into a
per-token weight that multiplies the policy loss (detached: it rescales the gradient, it
carries none), computed once on the controller from the ``old_log_probs`` and
``rollout_log_probs`` columns:

- ``tis``: truncated importance sampling, ``min(r_t, cap)`` (Yao et al., 2025; verl's TIS);
- ``icepop``: masked IS, ``r_t`` where ``low <= r_t <= high`` and 0 elsewhere (a token the two
  stacks disagree on that much carries no gradient);
- ``seq_mask``: sequence masking: 1, or 0 for every token of a sequence whose geometric-mean
  ratio ``exp(mean_t log r_t)`` is outside ``[low, high]``;
- ``seq_tis``: the sequence's geometric-mean ratio, truncated at ``cap``, on each of its tokens;
- ``none``: no correction (weights 1).

Each returns ``(weights [B, T], metrics)``; :func:`correction_metrics` adds what every one
reports (weight mean and max over response tokens, fraction masked, the log-prob gap).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from drivetrain.trainer.rl.registry import NamedRegistry

#: the per-token weight column the actor loss multiplies its policy loss with
IS_WEIGHTS = "is_weights"


@dataclass(frozen=True)
class CorrectionConfig:
    cap: float = 2.0  # tis, seq_tis: weights truncated here
    low: float = 0.5  # icepop, seq_mask: ratios below are masked
    high: float = 2.0  # icepop, seq_mask: ratios above are masked


@dataclass(frozen=True)
class CorrectionInputs:
    """Padded ``[B, T]`` tensors of the controller's batch."""

    old_log_probs: torch.Tensor  # the trainer's (proximal policy), before this update
    rollout_log_probs: torch.Tensor  # the rollout's (behaviour policy), as sampled
    mask: torch.Tensor  # 1 on response tokens

    @property
    def log_ratio(self) -> torch.Tensor:
        # clamped like the PPO ratio: exp of a huge gap overflows, and such a token is masked
        # or truncated by every correction anyway
        return ((self.old_log_probs - self.rollout_log_probs) * self.mask).clamp(-20.0, 20.0)

    def sequence_log_ratio(self) -> torch.Tensor:
        """``mean_t log r_t`` over each sequence's response tokens, ``[B, 1]``."""
        count = self.mask.sum(-1, keepdim=True).clamp(min=1)
        return self.log_ratio.sum(-1, keepdim=True) / count


CorrectionResult = tuple[torch.Tensor, Mapping[str, float]]
Correction = Callable[[CorrectionInputs, CorrectionConfig], CorrectionResult]
CORRECTIONS: NamedRegistry[Correction] = NamedRegistry("off-policy correction")


@CORRECTIONS.register("none")
def no_correction(inputs: CorrectionInputs, config: CorrectionConfig) -> CorrectionResult:
    return torch.ones_like(inputs.mask, dtype=torch.float32), {}


@CORRECTIONS.register("tis")
def truncated_is(inputs: CorrectionInputs, config: CorrectionConfig) -> CorrectionResult:
    ratio = inputs.log_ratio.exp()
    return ratio.clamp(max=config.cap), {"truncated_frac": _frac(ratio > config.cap, inputs.mask)}


@CORRECTIONS.register("icepop")
def masked_is(inputs: CorrectionInputs, config: CorrectionConfig) -> CorrectionResult:
    ratio = inputs.log_ratio.exp()
    keep = (ratio >= config.low) & (ratio <= config.high)
    return torch.where(keep, ratio, torch.zeros_like(ratio)), {}


@CORRECTIONS.register("seq_mask")
def sequence_mask(inputs: CorrectionInputs, config: CorrectionConfig) -> CorrectionResult:
    geometric = inputs.sequence_log_ratio().exp()
    keep = (geometric >= config.low) & (geometric <= config.high)
    weights = keep.to(torch.float32).expand_as(inputs.mask).contiguous()
    return weights, {"masked_sequences_frac": float((~keep).float().mean())}


@CORRECTIONS.register("seq_tis")
def sequence_truncated_is(inputs: CorrectionInputs, config: CorrectionConfig) -> CorrectionResult:
    geometric = inputs.sequence_log_ratio().exp()
    weights = geometric.clamp(max=config.cap).expand_as(inputs.mask).contiguous()
    return weights, {"truncated_sequences_frac": float((geometric > config.cap).float().mean())}


def correct(
    name: str, inputs: CorrectionInputs, config: CorrectionConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weights of correction ``name`` (0 off the response) and its metrics, prefixed
    ``off_policy/``."""
    weights, own = CORRECTIONS.get(name)(inputs, config)
    weights = weights.to(torch.float32) * inputs.mask
    metrics = {**correction_metrics(weights, inputs), **own}
    return weights, {f"off_policy/{k}": v for k, v in metrics.items()}


def correction_metrics(weights: torch.Tensor, inputs: CorrectionInputs) -> dict[str, float]:
    mask = inputs.mask.bool()
    on = weights[mask]
    gap = (inputs.old_log_probs - inputs.rollout_log_probs).abs()[mask]
    if on.numel() == 0:
        return {}
    return {
        "is_weight_mean": float(on.mean()),
        "is_weight_max": float(on.max()),
        "masked_frac": float((on == 0).float().mean()),
        "log_prob_gap": float(gap.mean()),
    }


def _frac(flags: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.bool()
    return float(flags[mask].float().mean()) if mask.any() else 0.0
