"""Played episodes as the RL step uses them: samples grouped by task, their rewards placed
on the turns that earned them, and the episode metrics."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from drivetrain.api import Batch
from drivetrain.api.columns import LOSS_MASK
from drivetrain.trainer.agentic.bounds import CUT_PREFIX
from drivetrain.trainer.agentic.episodes import PlayedEpisode
from drivetrain.trainer.rollout_batch import PROMPT_LENGTH
from drivetrain.trainer.trajectory import Trajectory

CALLS, SUCCEEDED = "tools/calls", "tools/succeeded"


def episode_samples(played: Sequence[PlayedEpisode]) -> tuple[list[Trajectory], torch.Tensor]:
    """The episodes as completions whose ``prompt_index`` is their task's place in the step
    (GRPO's group), and each episode's reward (the sum of its turns')."""
    samples = [dataclasses.replace(e.trajectory, prompt_index=e.task) for e in played]
    return samples, torch.tensor([e.reward for e in played], dtype=torch.float32)


def turn_rewards(batch: Batch, played: Sequence[PlayedEpisode]) -> torch.Tensor:
    """``[B, T]`` zeros with each turn's reward on that turn's last sampled token (a final
    reward lands on the last one): what per-token estimators (GAE) credit turn by turn;
    group estimators sum them to the episode's reward."""
    mask = batch[LOSS_MASK]
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    for row, (episode, offset) in enumerate(zip(played, batch[PROMPT_LENGTH], strict=True)):
        ends = episode.trajectory.turn_ends
        for end, reward in zip(ends, episode.turn_rewards, strict=True):
            rewards[row, int(offset) + end] += reward
    return rewards


def episode_metrics(played: Sequence[PlayedEpisode]) -> dict[str, float]:
    """Turns per episode, lengths, how episodes ended, tool calls and their success rate, and
    the environments' other numbers (means per episode)."""
    n = max(len(played), 1)
    turns = [e.turns for e in played]
    metrics = {
        "episode/turns_mean": sum(turns) / n,
        "episode/turns_max": float(max(turns, default=0)),
        "episode/tokens_mean": sum(len(e.trajectory.token_ids) for e in played) / n,
        "episode/sampled_tokens_mean": sum(e.trajectory.sampled_count for e in played) / n,
        "episode/done_frac": sum(not e.truncation for e in played) / n,
    }
    for reason in sorted({e.truncation for e in played if e.truncation}):
        metrics[f"episode/truncated/{reason}"] = sum(e.truncation == reason for e in played) / n
    totals: dict[str, float] = {}
    for episode in played:
        for key, value in episode.info.items():
            totals[key] = totals.get(key, 0.0) + value
    calls = totals.pop(CALLS, 0.0)
    succeeded = totals.pop(SUCCEEDED, 0.0)
    metrics["tools/calls_per_episode"] = calls / n
    if calls:
        metrics["tools/success_rate"] = succeeded / calls
    for key, value in sorted(totals.items()):  # the trainer's own cuts keep their names
        metrics[key if key.startswith(CUT_PREFIX) else f"env/{key}"] = value / n
    return metrics
