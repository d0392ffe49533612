"""A step's samples as groups: the ``n`` completions of each prompt with their rewards, split
from one generation call's output and joined back into one, and what a step generated. Every
source groups its samples this way (DAPO's dynamic sampling keeps or drops whole groups)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from drivetrain.api import Completion

#: the reward part holding the overlong penalty: it shapes the reward, it does not score the task
SHAPING = "overlong"

#: scores closer than this count as equal (rewards are sums of floats)
SAME_SCORE = 1e-6


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
