"""Each sample's reward on the controller: the weighted reward functions on the decoded
response, plus DAPO's overlong shaping where configured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.dapo import overlong_penalty
from drivetrain.trainer.rl.prompts import RLPrompt, row_ground_truth
from drivetrain.trainer.rl.rewards import RewardScorer
from drivetrain.trainer.rl.sample_groups import SHAPING


class SampleScorer:
    """``reward.functions`` (weighted) over completions, decoded with the run's tokenizer."""

    def __init__(self, config: RLConfig, tokenizer: Any) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.functions = RewardScorer(config.reward.functions, config.reward.weights)

    def __call__(
        self, completions: Sequence[Any], prompts: Sequence[RLPrompt], shaping: bool = True
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """Each sample's reward (the weighted reward functions, plus DAPO's overlong penalty
        when configured and ``shaping``) and each part's values."""
        decode = self.tokenizer.decode
        totals, parts = [], {name: [] for name in self.functions.names}
        for c in completions:
            text = decode(list(c.token_ids), skip_special_tokens=True)
            total, each = self.functions(text, prompts[c.prompt_index].ground_truth)
            totals.append(total)
            for name, value in each.items():
                parts[name].append(value)
        scores = torch.tensor(totals, dtype=torch.float32)
        dapo = self.config.algorithm.dapo
        if shaping and dapo.overlong_buffer > 0:
            penalty = overlong_penalty(
                [len(c.token_ids) for c in completions],
                self.config.sampling.max_new_tokens,
                dapo.overlong_buffer,
                dapo.overlong_penalty,
            )
            scores = scores + penalty
            parts[SHAPING] = penalty.tolist()
        return scores, parts

    def agent_reward(self, task: Any, text: str) -> float:
        """An agent's episode that reported no reward: the reward functions on its last turn
        against the task's ground truth, taken as the plain path takes it (data rows without
        one were refused at start: ``episode_setup``; an environment's task may have none)."""
        data = self.config.data
        truth = (
            row_ground_truth(task, data.answer_key, data.messages_key)
            if isinstance(task, Mapping)
            else None
        )
        return self.functions(text, truth or "")[0]
