"""DAPO's sampling-side pieces (Yu et al. 2025, "DAPO: an open-source LLM reinforcement
learning system at scale"): dynamic sampling, overlong reward shaping and overlong filtering.

- **Dynamic sampling**: a group whose samples all got the same reward has zero group-relative
  advantage everywhere; it costs a forward and backward and teaches nothing, and it shrinks
  the batch's effective size. Such groups are dropped and more prompts are sampled (as many as
  the missing groups need at the informative rate seen so far) until the step holds
  ``prompts_per_step`` informative groups, within ``max_sampling_rounds`` generation calls.
- **Overlong reward shaping**: a soft penalty that grows linearly over the last
  ``overlong_buffer`` fraction of ``max_new_tokens``, reaching ``-overlong_penalty`` at the
  limit, so a truncated answer is told apart from a wrong one gradually.
- **Overlong filtering**: truncated samples (finish reason ``length``) carry no loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from drivetrain.api import Batch, Completion, FinishReason
from drivetrain.api.columns import LOSS_MASK
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.rl.sample_groups import SampledGroup, generation_stats


@dataclass(frozen=True)
class DAPOConfig:
    """``algorithm.dapo``: the sampling-side pieces above (all off by default)."""

    #: drop groups whose samples all got the same reward and sample more prompts until the
    #: step holds run.prompts_per_step informative groups (sync mode)
    dynamic_sampling: bool = False
    max_sampling_rounds: int = 4  # generation calls per step at most, the first included
    #: soft overlong penalty over this last fraction of sampling.max_new_tokens (DAPO: 0.2;
    #: verl's overlong_buffer.len / max_response_length); 0: off
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0  # the penalty at sampling.max_new_tokens
    overlong_filter: bool = False  # truncated samples (finish reason length) carry no loss

    def __post_init__(self) -> None:
        if self.max_sampling_rounds < 1:
            raise ConfigError("algorithm.dapo.max_sampling_rounds must be >= 1")
        if not (0 <= self.overlong_buffer < 1 and self.overlong_penalty >= 0):
            raise ConfigError(
                "algorithm.dapo.overlong_buffer must be in [0, 1) (a fraction of "
                "sampling.max_new_tokens), overlong_penalty >= 0"
            )


def overlong_penalty(
    lengths: Sequence[int], max_new_tokens: int, buffer: float, factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment per sample: 0 up to ``L_max - L_cache`` tokens, then
    ``((L_max - L_cache) - length) / L_cache * factor`` down to ``-factor`` at ``L_max``
    (``L_max = max_new_tokens``, ``L_cache = buffer * L_max``, at least one token)."""
    cache = max(1.0, buffer * max_new_tokens)
    start = max_new_tokens - cache
    over = torch.as_tensor(list(lengths), dtype=torch.float32) - start
    return -(over.clamp(min=0.0) / cache).clamp(max=1.0) * factor


@dataclass(frozen=True)
class DynamicSample:
    kept: list[SampledGroup]  # what the step trains on
    generated: list[SampledGroup]  # every group generated this step (for reward metrics)
    rounds: int

    def metrics(self) -> dict[str, float]:
        return {
            **generation_stats(self.generated),
            "sampling/rounds": float(self.rounds),
            "sampling/kept_groups": float(len(self.kept)),
        }


def dynamic_sample(
    first: Sequence[SampledGroup],
    more: Callable[[int, int], Sequence[SampledGroup]],
    wanted: int,
    max_rounds: int,
) -> DynamicSample:
    """Informative groups of ``first`` and of ``more(round, prompts)`` (round 1, 2, ...) until
    ``wanted`` are held or ``max_rounds`` calls were made (``first`` is round 0); the first
    ``wanted`` in generation order. Each extra round asks for the prompts the missing groups
    need at the informative rate seen so far (at most ``wanted``), not a whole step's worth:
    a step missing two groups of 32 generates about two more. When no group at all is
    informative, the first round's groups are kept (the step's update then carries no policy
    gradient, as plain GRPO's would)."""
    generated = list(first)
    kept = [g for g in first if g.informative]
    rounds = 1
    while len(kept) < wanted and rounds < max_rounds:
        rate = max(len(kept), 1) / max(len(generated), 1)
        prompts = min(wanted, math.ceil((wanted - len(kept)) / rate))
        extra = list(more(rounds, prompts))
        rounds += 1
        generated.extend(extra)
        kept.extend(g for g in extra if g.informative)
    if not kept:
        kept = list(first)
    return DynamicSample(kept[:wanted], generated, rounds)


def filter_truncated(batch: Batch, completions: Sequence[Completion]) -> tuple[Batch, float]:
    """``batch`` with the loss mask of truncated samples (finish reason ``length``) zeroed, and
    the fraction zeroed. When every sample was truncated nothing is zeroed (an update with no
    loss token is an error); the fraction, 1.0, says so."""
    cut = torch.tensor([c.finish_reason is FinishReason.LENGTH for c in completions])
    frac = float(cut.float().mean()) if len(cut) else 0.0
    if bool(cut.all()):
        return batch, frac
    mask = batch[LOSS_MASK] * (~cut).to(batch[LOSS_MASK].dtype)[:, None]
    return batch.with_columns(loss_mask=mask), frac
