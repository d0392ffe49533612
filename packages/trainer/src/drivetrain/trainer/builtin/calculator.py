"""The built-in agentic task: two-step arithmetic the model solves with a calculator tool.

A task is ``(a op b) op c`` with two-digit numbers and at least one product ("What is
(47*83)+12?"): more than a small model can work out in its head, and the calculator does one
operation per call, so a solution takes three turns: a call for the bracket, a call with its
result, and the answer. The reward is 1 for the exact answer, else 0; a malformed call, an
unknown tool or a calculator error is an error observation the model can recover from.

``drivetrain grpo env=calculator`` with no model starts from the built-in SFT model of this
task (:mod:`drivetrain.trainer.builtin.calculator_assets`), which imitated a careless
annotator: GRPO trains its slips out.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from drivetrain.api.environment import AssistantTurn, Environment, Episode, StepResult, Task
from drivetrain.api.tools import Tool
from drivetrain.runtime.tool_calls import run_tool_calls

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_EXPRESSION = re.compile(r"\s*(-?\d{1,12})\s*([+\-*])\s*(-?\d{1,12})\s*")


def calculate(expression: str) -> str:
    """One operation on two integers, ``a+b``, ``a-b`` or ``a*b``."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"{expression!r} is not one operation on two integers (a+b, a-b, a*b)")
    a, op, b = match.groups()
    return str(OPERATIONS[op](int(a), int(b)))


CALCULATOR = Tool(
    name="calculator",
    description="Computes one operation on two integers: a+b, a-b or a*b.",
    parameters={
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 47*83"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    function=calculate,
    timeout_s=5.0,
)
TOOLS = {CALCULATOR.name: CALCULATOR}


def problem(rng: random.Random) -> dict[str, Any]:
    """A task: the question, its two steps and the answer."""
    a, b, c = (rng.randrange(10, 100) for _ in range(3))
    first, second = rng.choice("*+-*"), rng.choice("+-*")
    if "*" not in (first, second):
        first = "*"
    inner = int(calculate(f"{a}{first}{b}"))
    answer = int(calculate(f"{inner}{second}{c}"))
    return {
        "question": f"What is ({a}{first}{b}){second}{c}?",
        "steps": [f"{a}{first}{b}", f"{inner}{second}{c}"],
        "answer": str(answer),
    }


def tasks(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(count)]


#: seeds of the two splits: distinct, so validation questions are (almost surely) unseen
SPLIT_SEEDS = {"train": 11, "val": 12}


class CalculatorEpisode(Episode):
    def __init__(self, task: Task) -> None:
        self.question, self.answer = str(task["question"]), str(task["answer"])

    def reset(self) -> Sequence[Mapping[str, Any]]:
        return [{"role": "user", "content": self.question}]

    def step(self, turn: AssistantTurn) -> StepResult:
        if turn.tool_calls or turn.call_errors:
            observations, info = run_tool_calls(TOOLS, turn)
            return StepResult(tuple(observations), 0.0, False, info)
        correct = turn.content.strip() == self.answer
        return StepResult(reward=1.0 if correct else 0.0, done=True)


class CalculatorEnvironment(Environment):
    """Options: none (the task family is fixed)."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        if self.options:
            raise ValueError(f"the calculator environment takes no options, got {self.options}")

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return [CALCULATOR.schema()]

    def episode(self, task: Task) -> Episode:
        return CalculatorEpisode(task)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        if split not in SPLIT_SEEDS:
            raise ValueError(f"unknown split {split!r}; splits: {', '.join(SPLIT_SEEDS)}")
        return list(tasks(count, SPLIT_SEEDS[split] + 1_000 * seed))
