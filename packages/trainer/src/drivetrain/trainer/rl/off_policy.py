"""Off-policy corrections, registered by name (``algorithm.correction``).

The rollout sampled each token under a *behaviour* policy ``μ`` (its own log-probs: an older
weight version in async modes, and a different numeric stack everywhere); the trainer's loss
takes the PPO ratio against the *proximal* policy ``π_old``, its own log-probs of the batch
before this update. A correction turns the per-token gap ``r_t = π_old(y_t) / μ(y_t)`` into a
per-token weight that multiplies the policy loss (detached: it rescales the gradient, it
carries none). The actor loss computes it on each micro-batch (:func:`correct`), from the
``old_log_probs`` column or, with one update per batch, from its own forward's log-probs
(they are the proximal policy then, so no separate forward computes them):

- ``tis``: truncated importance sampling, ``min(r_t, cap)`` (Yao et al., 2025; verl's TIS);
- ``icepop``: masked IS, ``r_t`` where ``low <= r_t <= high`` and 0 elsewhere (a token the two
  stacks disagree on that much carries no gradient);
- ``seq_mask``: sequence masking: 1, or 0 for every token of a sequence whose geometric-mean
  ratio ``exp(mean_t log r_t)`` is outside ``[low, high]``;
- ``seq_tis``: the sequence's geometric-mean ratio, truncated at ``cap``, on each of its tokens;
- ``none``: no correction (weights 1).

Each returns a :class:`Corrected`: the weights and 0/1 flags per token or per sequence (what
was truncated or masked); :func:`correct` turns them into metrics every correction reports
(weight mean and max over response tokens, fraction masked, the log-prob gap, the fraction of
tokens without one), as shares of the mini-batch's global counts like every loss metric.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.named_registry import NamedRegistry
from drivetrain.trainer.rl.aggregation import expand_sequences, sequence_means


@dataclass(frozen=True)
class CorrectionConfig:
    """``algorithm.correction``: the off-policy correction of the rollout↔trainer gap."""

    #: a registered correction, or auto: tis when samples may be stale (one_step_off, async
    #: with max_staleness > 0), else none
    method: str = "auto"
    cap: float = 2.0  # tis, seq_tis: weights truncated here
    low: float = 0.5  # icepop, seq_mask: ratios below are masked
    high: float = 2.0  # icepop, seq_mask: ratios above are masked

    def __post_init__(self) -> None:
        if not (self.cap > 0 and 0 <= self.low <= self.high):
            raise ConfigError(
                "algorithm.correction.cap must be > 0 and 0 <= correction.low <= correction.high"
            )


@dataclass(frozen=True)
class CorrectionInputs:
    """Token tensors laid out like the loss's micro-batch: padded ``[b, T]`` or packed
    ``[tokens]`` (``seq_lens`` says where each sequence ends)."""

    old_log_probs: torch.Tensor  # the trainer's (proximal policy), before this update
    rollout_log_probs: torch.Tensor  # the rollout's (behaviour policy), as sampled
    mask: torch.Tensor  # 1 on response tokens
    seq_lens: Sequence[int]

    @property
    def log_ratio(self) -> torch.Tensor:
        # clamped like the PPO ratio: exp of a huge gap overflows, and such a token is masked
        # or truncated by every correction anyway
        return ((self.old_log_probs - self.rollout_log_probs) * self.mask).clamp(-20.0, 20.0)

    def sequence_log_ratio(self) -> torch.Tensor:
        """``mean_t log r_t`` over each sequence's response tokens, one per sequence."""
        return sequence_means(self.log_ratio, self.mask, self.seq_lens)

    def per_token(self, per_sequence: torch.Tensor) -> torch.Tensor:
        return expand_sequences(per_sequence, self.mask, self.seq_lens).contiguous()


@dataclass(frozen=True)
class Corrected:
    """A correction's per-token weights, and named 0/1 flags of what it truncated or masked:
    per token (reported as a fraction of response tokens) or per sequence (of sequences)."""

    weights: torch.Tensor
    token_flags: Mapping[str, torch.Tensor] = field(default_factory=dict)
    sequence_flags: Mapping[str, torch.Tensor] = field(default_factory=dict)


Correction = Callable[[CorrectionInputs, CorrectionConfig], Corrected]
CORRECTIONS: NamedRegistry[Correction] = NamedRegistry("off-policy correction")


@CORRECTIONS.register("none")
def no_correction(inputs: CorrectionInputs, config: CorrectionConfig) -> Corrected:
    return Corrected(torch.ones_like(inputs.mask, dtype=torch.float32))


@CORRECTIONS.register("tis")
def truncated_is(inputs: CorrectionInputs, config: CorrectionConfig) -> Corrected:
    ratio = inputs.log_ratio.exp()
    return Corrected(ratio.clamp(max=config.cap), {"truncated_frac": ratio > config.cap})


@CORRECTIONS.register("icepop")
def masked_is(inputs: CorrectionInputs, config: CorrectionConfig) -> Corrected:
    ratio = inputs.log_ratio.exp()
    keep = (ratio >= config.low) & (ratio <= config.high)
    return Corrected(torch.where(keep, ratio, torch.zeros_like(ratio)))


@CORRECTIONS.register("seq_mask")
def sequence_mask(inputs: CorrectionInputs, config: CorrectionConfig) -> Corrected:
    geometric = inputs.sequence_log_ratio().exp()
    keep = (geometric >= config.low) & (geometric <= config.high)
    weights = inputs.per_token(keep.to(torch.float32))
    return Corrected(weights, sequence_flags={"masked_sequences_frac": ~keep})


@CORRECTIONS.register("seq_tis")
def sequence_truncated_is(inputs: CorrectionInputs, config: CorrectionConfig) -> Corrected:
    geometric = inputs.sequence_log_ratio().exp()
    weights = inputs.per_token(geometric.clamp(max=config.cap))
    return Corrected(weights, sequence_flags={"truncated_sequences_frac": geometric > config.cap})


def correct(
    name: str,
    inputs: CorrectionInputs,
    config: CorrectionConfig,
    *,
    global_tokens: int | None = None,
    global_sequences: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weights of correction ``name`` (0 off the response, detached) and its metrics,
    prefixed ``off_policy/``: 0-d tensors, shares of ``global_tokens`` response tokens and
    ``global_sequences`` sequences (default: this batch's own, which makes them means).
    Masked reductions only: no value is read back to the host here (the engine reads the
    metrics once)."""
    mask = inputs.mask.detach().to(torch.float32)
    detached = CorrectionInputs(
        inputs.old_log_probs.detach(), inputs.rollout_log_probs.detach(), mask, inputs.seq_lens
    )
    found = CORRECTIONS.get(name)(detached, config)
    weights = found.weights.to(torch.float32) * mask
    tokens = max(global_tokens if global_tokens is not None else int(mask.sum()), 1)
    sequences = max(global_sequences if global_sequences is not None else len(inputs.seq_lens), 1)
    gap = (detached.old_log_probs - detached.rollout_log_probs).abs() * mask
    metrics = {
        "is_weight_mean": weights.sum() / tokens,
        "is_weight_max": weights.max(),  # weights >= 0 and 0 off the response; *_max: by max
        "masked_frac": ((weights == 0).to(torch.float32) * mask).sum() / tokens,
        "log_prob_gap": gap.sum() / tokens,
        # tokens whose two log-probs are the same bits: the correction is a no-op on them
        # (all of them under numerics=exact for tokens sampled from the current weights)
        "exact_frac": ((gap == 0).to(torch.float32) * mask).sum() / tokens,
    }
    for key, flags in found.token_flags.items():
        metrics[key] = (flags.to(torch.float32) * mask).sum() / tokens
    for key, flags in found.sequence_flags.items():
        metrics[key] = flags.to(torch.float32).sum() / sequences
    return weights, {f"off_policy/{k}": v for k, v in metrics.items()}
