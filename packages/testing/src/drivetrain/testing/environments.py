"""A test-double RL environment: ``echo`` (hidden from users' jobs, like the ``fake`` engine).

Each task asks the policy to say a number (``{"prompt": "say 7", "answer": "7"}``); its one
tool, ``echo``, returns its ``text`` argument. The episode ends at the first turn without a
tool call, or at the end of the ``turns``-th turn that called tools (``env_options.turns``,
default 3); the turn that ends it earns 1.0 when its content is the answer. So a policy that
never calls a tool (the fake rollout) plays one-turn episodes, and a scripted one can make
episodes of any length up to ``turns``. Standard library only.
"""

from __future__ import annotations

import random
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


def _echo(text: str) -> str:
    return text


ECHO_TOOL = Tool(
    name="echo",
    description="Returns the text it is given.",
    parameters={
        "type": "object",
        "properties": {"text": {"type": "string", "description": "what to echo"}},
        "required": ["text"],
        "additionalProperties": False,
    },
    function=_echo,
)


def echo_task(number: int) -> dict[str, str]:
    return {"prompt": f"say {number}", "answer": str(number)}


class EchoEpisode(Episode):
    def __init__(self, task: Task, tools: Mapping[str, Tool], turns: int) -> None:
        self.task = task
        self.tools = tools
        self.turns = turns
        self.tool_turns = 0

    def reset(self) -> Sequence[Message]:
        return [{"role": "user", "content": str(self.task["prompt"])}]

    def step(self, turn: AssistantTurn) -> StepResult:
        answered = turn.content.strip() == str(self.task["answer"])
        if not (turn.tool_calls or turn.call_errors):
            return StepResult(reward=float(answered), done=True)
        observations, info = run_tool_calls(self.tools, turn)
        self.tool_turns += 1
        done = self.tool_turns >= self.turns
        reward = float(answered) if done else 0.0
        return StepResult(tuple(observations), reward=reward, done=done, info=info)


class EchoEnvironment(Environment):
    """``env=echo`` in tests (``DRIVETRAIN_TEST_PLUGINS=1``); ``env_options``: ``turns``."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        unknown = sorted(set(self.options) - {"turns"})
        if unknown:
            raise ValueError(f"echo environment: unknown env_options {unknown}; it takes: turns")
        turns = self.options.get("turns", 3)
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(
                f"echo environment: env_options.turns must be an integer >= 1, got {turns!r}"
            )
        self.turns = turns
        self._tools = {ECHO_TOOL.name: ECHO_TOOL}

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]

    def episode(self, task: Task) -> Episode:
        return EchoEpisode(task, self._tools, self.turns)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        rng = random.Random(f"echo:{split}:{seed}")
        return [echo_task(rng.randrange(100)) for _ in range(count)]
