"""The RL step's summary numbers: rewards, the share of samples cut at their budget, the
optimizer steps of a step averaged, and one line of metrics for the console."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from drivetrain.api import FinishReason
from drivetrain.api.loss import MAX_SUFFIX
from drivetrain.trainer.rl.sample_groups import SHAPING
from drivetrain.trainer.trajectory import Trajectory
from drivetrain.trainer.workers.engine_worker import StepStats


def clip_ratio(completions: Sequence[Any], lengths: torch.Tensor, max_new_tokens: int) -> float:
    """Share of samples cut at their token budget: an episode whose last turn was (its
    sampled tokens add up over turns), a completion at ``max_new_tokens``."""
    if completions and isinstance(completions[0], Trajectory):
        return sum(c.finish_reason is FinishReason.LENGTH for c in completions) / len(completions)
    return float((lengths >= max_new_tokens).float().mean())


def reward_stats(scores: torch.Tensor, parts: dict[str, list[float]]) -> dict[str, float]:
    """Mean and std of the rewards, each part's mean, and with DAPO's overlong shaping the task's
    own reward (``reward/task``: the mean without the penalty, which can dominate the total)."""
    metrics = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std())}
    metrics.update({f"reward/{n}": sum(v) / len(v) for n, v in parts.items()})
    if SHAPING in parts:
        metrics["reward/task"] = metrics["reward/mean"] - metrics[f"reward/{SHAPING}"]
    return metrics


def mean_stats(stats: Sequence[StepStats]) -> StepStats:
    n = len(stats)
    keys = {k for s in stats for k in s.metrics}
    return StepStats(
        loss=sum(s.loss for s in stats) / n,
        grad_norm=sum(s.grad_norm for s in stats) / n,
        lr=stats[-1].lr,
        num_tokens=sum(s.num_tokens for s in stats),
        metrics={
            k: mean_or_max(k, [float(s.metrics[k]) for s in stats if k in s.metrics]) for k in keys
        },
    )


def mean_or_max(name: str, values: list[float]) -> float:
    return max(values) if name.endswith(MAX_SUFFIX) else sum(values) / len(values)


def fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(metrics.items()))
