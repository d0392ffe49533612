"""Inventory questions answered with a ``lookup`` tool, over several turns.

Each task asks how many of two items are in stock together. The policy can read one item's
count per call of ``lookup``, so a good episode is: look up the first item, look up the second
(in one turn or two), then answer with the sum. The turn without a tool call is the answer;
it earns 1.0 when its last number is the sum. An episode also ends, unrewarded, after
``max_lookups`` calls (``env_options.max_lookups``, default 4).

The environment makes its own tasks (``tasks``), so a run needs no dataset:
``drivetrain grpo env=acme_lookup``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from drivetrain.api.environment import (
    AssistantTurn,
    Environment,
    Episode,
    Message,
    StepResult,
    Task,
)
from drivetrain.api.tools import Tool
from drivetrain.runtime.tool_calls import run_tool_calls

INVENTORY = {"apple": 3, "pear": 5, "plum": 2, "fig": 7, "kiwi": 4, "lime": 6, "date": 9}
SYSTEM = "Answer with a number. Use the lookup tool to read stock counts."


def lookup(item: str) -> str:
    """The tool's function: the policy's argument is untrusted, so an unknown item is a
    message to read, not an exception."""
    count = INVENTORY.get(item.strip().lower())
    if count is None:
        return f"no item {item!r}; items: {', '.join(sorted(INVENTORY))}"
    return str(count)


LOOKUP = Tool(
    name="lookup",
    description="How many of an item are in stock.",
    parameters={
        "type": "object",
        "properties": {"item": {"type": "string", "description": "e.g. apple"}},
        "required": ["item"],
        "additionalProperties": False,
    },
    function=lookup,
    timeout_s=1.0,
)


class LookupEpisode(Episode):
    """One question. Holds only its own state, so episodes may step in parallel."""

    def __init__(self, task: Task, max_lookups: int) -> None:
        self.task = task
        self.max_lookups = max_lookups
        self.lookups = 0

    def reset(self) -> Sequence[Message]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": str(self.task["prompt"])},
        ]

    def step(self, turn: AssistantTurn) -> StepResult:
        if not (turn.tool_calls or turn.call_errors):  # the answer
            numbers = re.findall(r"-?\d+", turn.content)
            correct = bool(numbers) and numbers[-1] == str(self.task["answer"])
            return StepResult(reward=float(correct), done=True)
        observations, info = run_tool_calls({LOOKUP.name: LOOKUP}, turn)
        self.lookups += len(turn.tool_calls) + len(turn.call_errors)
        return StepResult(tuple(observations), done=self.lookups >= self.max_lookups, info=info)


class LookupEnvironment(Environment):
    """``env=acme_lookup``; ``env_options``: ``max_lookups``."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(set(self.options) - {"max_lookups"})
        if unknown:
            raise ValueError(f"acme_lookup: unknown env_options {unknown}; it takes: max_lookups")
        self.max_lookups = int(self.options.get("max_lookups", 4))
        if self.max_lookups < 1:
            raise ValueError(f"acme_lookup: max_lookups must be >= 1, got {self.max_lookups}")

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return [LOOKUP.schema()]

    def episode(self, task: Task) -> Episode:
        return LookupEpisode(task, self.max_lookups)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        rng = random.Random(f"acme:{split}:{seed}")  # train and val questions differ
        tasks = []
        for _ in range(count):
            first, second = rng.sample(sorted(INVENTORY), 2)
            prompt = f"How many {first}s and {second}s are in stock together?"
            tasks.append({"prompt": prompt, "answer": str(INVENTORY[first] + INVENTORY[second])})
        return tasks
