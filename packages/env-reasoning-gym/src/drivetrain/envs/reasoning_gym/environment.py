"""reasoning-gym's procedural reasoning tasks as episodes, each scored by its dataset's own
``score_answer``.

``episode.options`` (``drivetrain grpo env=reasoning_gym episode.options.dataset=chain_sum``):

- ``dataset`` (required): a reasoning-gym dataset by name (``chain_sum``, ``basic_arithmetic``,
  ``letter_counting``...);
- ``system_prompt``: one of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``simple``,
  ``direct``, ``DeepSeekZero``, ``chain_of_draft``), or ``""`` for none; default ``default``.
  Each asks for the final answer between ``<answer>`` and ``</answer>``, which is what is scored;
- ``attempts``: answers an episode takes (default 1). A wrong one with attempts left is told so
  and the policy answers again (multi-turn); the episode's reward is the last answer's score;
- any field of the dataset's own config (``min_terms``, ``max_digits``...), checked against it;
  ``seed`` and ``size`` are not options: the run's seed and task counts set them.

Tasks are made by the environment (no dataset file): ``tasks(split, count, seed)`` builds the
dataset from a seed derived from the run's seed and the split, so a run's train and held-out
tasks are reproducible and (reasoning-gym draws item ``i`` from ``seed + i``) do not overlap.
"""

from __future__ import annotations

import dataclasses
import difflib
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from drivetrain.api.environment import (
    AssistantTurn,
    Environment,
    Episode,
    Message,
    StepResult,
    Task,
)

OWN_OPTIONS = ("dataset", "system_prompt", "attempts")
RUN_SET = ("seed", "size")  # dataset config fields the run decides
RETRY = (
    "That is not correct. Think again, then give only the final answer between <answer> and "
    "</answer>."
)
NO_ANSWER = "No final answer found: give it between <answer> and </answer>."


def dataset_names() -> list[str]:
    return sorted(DATASETS)


def split_seed(split: str, seed: int) -> int:
    """The dataset seed of a split: far apart for different splits (reasoning-gym draws item
    ``i`` from ``seed + i``, so nearby seeds would share items)."""
    return zlib.crc32(f"drivetrain:{split}:{seed}".encode())


class ReasoningGymEpisode(Episode):
    """One question; its own state only, so episodes may step in parallel."""

    def __init__(
        self,
        task: Task,
        system: str,
        attempts: int,
        score: Callable[[str | None, dict[str, Any]], float],
    ) -> None:
        self.task, self.system, self.attempts_left, self.score = task, system, attempts, score

    def reset(self) -> Sequence[Message]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": str(self.task["question"])}]

    def step(self, turn: AssistantTurn) -> StepResult:
        answer = extract_answer(turn.content)
        entry = {key: self.task[key] for key in ("question", "answer", "metadata")}
        score = float(self.score(answer, entry))
        self.attempts_left -= 1
        info = {"reasoning_gym/answered": float(answer is not None)}
        if score >= 1.0 or self.attempts_left <= 0:
            return StepResult(reward=score, done=True, info=info)
        feedback = {"role": "user", "content": RETRY if answer is not None else NO_ANSWER}
        return StepResult((feedback,), info=info)


class ReasoningGymEnvironment(Environment):
    """``env=reasoning_gym``; options in the module docstring."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        name = self.options.get("dataset")
        if not name:
            raise ValueError(
                "reasoning_gym: set episode.options.dataset to one of its "
                f"{len(DATASETS)} datasets, e.g. {', '.join(dataset_names()[:6])}"
            )
        if name not in DATASETS:
            near = difflib.get_close_matches(str(name), dataset_names(), n=3)
            hint = f"did you mean {', '.join(near)}?" if near else f"e.g. {dataset_names()[:6]}"
            raise ValueError(f"reasoning_gym: no dataset {name!r}; {hint}")
        self.dataset = str(name)
        fields = [f.name for f in dataclasses.fields(DATASETS[self.dataset][1])]
        allowed = [f for f in fields if f not in RUN_SET]
        self.config = {k: v for k, v in self.options.items() if k not in OWN_OPTIONS}
        unknown = sorted(set(self.config) - set(allowed))
        if unknown:
            raise ValueError(
                f"reasoning_gym: dataset {self.dataset} has no option {', '.join(unknown)}; it "
                f"takes {', '.join(OWN_OPTIONS)} and its own {', '.join(allowed) or '(none)'}"
            )
        prompt = self.options.get("system_prompt", "default")
        if prompt and prompt not in SYSTEM_PROMPTS:
            raise ValueError(
                f"reasoning_gym: system_prompt {prompt!r} is none of {sorted(SYSTEM_PROMPTS)} "
                "(or '' for none)"
            )
        self.system = SYSTEM_PROMPTS[prompt] if prompt else ""
        self.attempts = int(self.options.get("attempts", 1))
        if self.attempts < 1:
            raise ValueError(f"reasoning_gym: attempts must be >= 1, got {self.attempts}")
        self.score = self._make(seed=0, size=1).score_answer  # the config may shape the scorer

    def _make(self, *, seed: int, size: int) -> Any:
        try:
            return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **self.config)
        except (AssertionError, TypeError, ValueError) as exc:  # its validate() asserts
            raise ValueError(
                f"reasoning_gym: dataset {self.dataset} rejects options {self.config}: {exc}"
            ) from None

    def episode(self, task: Task) -> Episode:
        return ReasoningGymEpisode(task, self.system, self.attempts, self.score)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        data = self._make(seed=split_seed(split, seed), size=count)
        return [
            {"question": item["question"], "answer": item["answer"], "metadata": item["metadata"]}
            for item in (data[i] for i in range(count))
        ]
