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
from dataclasses import dataclass, replace
from typing import Any

import torch

from drivetrain.api import Batch, Completion, FinishReason
from drivetrain.api.columns import LOSS_MASK
from drivetrain.api.errors import ConfigError

#: the reward part holding the overlong penalty: it shapes the reward, it does not score the task
SHAPING = "overlong"

#: scores closer than this count as equal (rewards are sums of floats)
SAME_SCORE = 1e-6


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
class SampledGroup:
    """The ``n`` samples of one prompt and their rewards."""

    prompt: Any  # the prompt the samples answer
    completions: tuple[Completion, ...]
    scores: torch.Tensor  # [n]
    parts: dict[str, list[float]]  # each reward function's values

    @property
    def informative(self) -> bool:
        """The verifier's rewards differ (the overlong shaping is left out, as DAPO filters
        on accuracy: lengths alone make no signal worth a slot)."""
        shaping = torch.as_tensor(self.parts.get(SHAPING, [0.0] * len(self.scores)))
        verdict = self.scores - shaping.to(self.scores.dtype)
        return float(verdict.max() - verdict.min()) > SAME_SCORE


def split_groups(
    prompts: Sequence[Any],
    completions: Sequence[Completion],
    scores: torch.Tensor,
    parts: dict[str, list[float]],
) -> list[SampledGroup]:
    """One call's completions (``prompt_index`` indexes ``prompts``) as per-prompt groups."""
    members: list[list[int]] = [[] for _ in prompts]
    for i, c in enumerate(completions):
        members[c.prompt_index].append(i)
    return [
        SampledGroup(
            prompts[p],
            tuple(completions[i] for i in idx),
            scores[idx],
            {name: [values[i] for i in idx] for name, values in parts.items()},
        )
        for p, idx in enumerate(members)
    ]


def join_groups(
    groups: Sequence[SampledGroup],
) -> tuple[list[Any], list[Completion], torch.Tensor, dict[str, list[float]]]:
    """Groups as one call's output: prompts, completions (``prompt_index`` renumbered),
    scores and reward parts."""
    completions = [
        replace(c, prompt_index=i) for i, group in enumerate(groups) for c in group.completions
    ]
    scores = torch.cat([g.scores for g in groups]) if groups else torch.zeros(0)
    names = groups[0].parts if groups else {}
    parts = {name: [v for g in groups for v in g.parts[name]] for name in names}
    return [g.prompt for g in groups], completions, scores, parts


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


def generation_stats(groups: Sequence[SampledGroup]) -> dict[str, float]:
    """What a step generated: groups, samples, tokens, and the share of groups whose samples
    all got the same reward (no group-relative signal)."""
    zero = sum(not g.informative for g in groups)
    return {
        "sampling/generated_groups": float(len(groups)),
        "sampling/generated_samples": float(sum(len(g.completions) for g in groups)),
        "sampling/generated_tokens": float(
            sum(len(c.token_ids) for g in groups for c in g.completions)
        ),
        "sampling/zero_variance_frac": zero / max(len(groups), 1),
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
