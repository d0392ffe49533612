"""reasoning-gym's procedural reasoning tasks as episodes, each scored by its dataset's own
``score_answer``.

``episode.options`` (``drivetrain grpo env=reasoning_gym episode.options.dataset=chain_sum``):

- ``dataset`` (required): a reasoning-gym dataset by name (``chain_sum``, ``basic_arithmetic``,
  ``letter_counting``...);
- ``system_prompt``: one of reasoning-gym's ``SYSTEM_PROMPTS`` (``default``, ``simple``,
  ``direct``, ``DeepSeekZero``, ``chain_of_draft``), or ``""`` for none; default ``default``.
  Each asks for the final answer between ``<answer>`` and ``</answer>``, which is what is scored;
- ``instruction``: text added after each question (``Reply with the number only.``); default
  none;
- ``answer_format``: where the answer is read: ``tags`` (default: between ``<answer>`` and
  ``</answer>``, reasoning-gym's convention), ``last_number`` (the reply's last number: for
  numeric datasets and models too small to follow the tags, as SmolLM2-135M) or ``reply`` (the
  whole reply, stripped);
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
import re
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

OWN_OPTIONS = ("dataset", "system_prompt", "instruction", "answer_format", "attempts")
RUN_SET = ("seed", "size")  # dataset config fields the run decides
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(reply: str) -> str | None:
    numbers = NUMBER.findall(reply)
    return numbers[-1] if numbers else None


#: ``answer_format``: how the answer is read from a reply, and what a retry asks for.
ANSWER_FORMATS: dict[str, tuple[Callable[[str], str | None], str]] = {
    "tags": (extract_answer, "give only the final answer between <answer> and </answer>"),
    "last_number": (last_number, "give only the final number"),
    "reply": (lambda reply: reply.strip() or None, "give only the final answer"),
}


def dataset_names() -> list[str]:
    return sorted(DATASETS)


def split_seed(split: str, seed: int) -> int:
    """The dataset seed of a split: far apart for different splits (reasoning-gym draws item
    ``i`` from ``seed + i``, so nearby seeds would share items)."""
    return zlib.crc32(f"drivetrain:{split}:{seed}".encode())


class ReasoningGymEpisode(Episode):
    """One question; its own state only, so episodes may step in parallel."""

    def __init__(self, env: ReasoningGymEnvironment, task: Task) -> None:
        self.env, self.task, self.attempts_left = env, task, env.attempts

    def reset(self) -> Sequence[Message]:
        system = [{"role": "system", "content": self.env.system}] if self.env.system else []
        question = " ".join(filter(None, (str(self.task["question"]), self.env.instruction)))
        return [*system, {"role": "user", "content": question}]

    def step(self, turn: AssistantTurn) -> StepResult:
        answer = self.env.answer_of(turn.content)
        score = self.env.scored(answer, self.task)
        self.attempts_left -= 1
        info = {"reasoning_gym/answered": float(answer is not None)}
        if score >= 1.0 or self.attempts_left <= 0:
            return StepResult(reward=score, done=True, info=info)
        again = (
            "That is not correct. Think again, then " if answer is not None else "No answer found: "
        )
        feedback = {"role": "user", "content": f"{again}{self.env.ask}."}
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
        self.instruction = str(self.options.get("instruction") or "")
        self.answer_format = str(self.options.get("answer_format", "tags"))
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"reasoning_gym: answer_format is one of {', '.join(ANSWER_FORMATS)}, got "
                f"{self.answer_format!r}"
            )
        self.answer_of, self.ask = ANSWER_FORMATS[self.answer_format]
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

    def scored(self, answer: str | None, task: Task) -> float:
        """The dataset's score of ``answer`` to ``task`` (0 to 1)."""
        entry = {key: task[key] for key in ("question", "answer", "metadata")}
        return float(self.score(answer, entry))

    def episode(self, task: Task) -> Episode:
        return ReasoningGymEpisode(self, task)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        data = self._make(seed=split_seed(split, seed), size=count)
        return [
            {"question": item["question"], "answer": item["answer"], "metadata": item["metadata"]}
            for item in (data[i] for i in range(count))
        ]
