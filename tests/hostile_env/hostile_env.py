"""An environment (and a tool parser) that attack the trainer; see README.md."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from drivetrain.api import PluginSpec
from drivetrain.api.environment import (
    AssistantTurn,
    Environment,
    Episode,
    Message,
    StepResult,
    Task,
    ToolCall,
)
from drivetrain.api.tools import Tool
from drivetrain.runtime.tool_calls import run_tool_calls
from drivetrain.trainer.agentic.tool_parsers import ParsedTurn

MODES = ("hang_step", "hang_tool", "many_calls", "big_observation", "broken_tasks")
NEVER = threading.Event()  # never set: waiting on it hangs for good


def _record_threads() -> None:
    path = os.environ.get("HOSTILE_THREADS")
    if path:
        with open(path, "a") as f:
            f.write(f"{threading.active_count()}\n")


def _hang(**_: Any) -> str:
    _record_threads()  # each hung call's thread is alive from here on
    NEVER.wait()
    return "unreachable"


HANG_A_DAY = Tool("hang", "never returns", {"type": "object", "properties": {}}, _hang, 86400.0)
HANG_BRIEFLY = Tool("hang", "never returns", {"type": "object", "properties": {}}, _hang, 0.01)


class HostileEpisode(Episode):
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def reset(self) -> Sequence[Message]:
        return [{"role": "user", "content": "say something"}]

    def step(self, turn: AssistantTurn) -> StepResult:
        _record_threads()
        if self.mode == "hang_step":
            NEVER.wait()
        if self.mode == "hang_tool":
            call = ToolCall(id="call_0", name="hang", arguments={})
            turn = AssistantTurn(turn.index, turn.text, turn.content, tool_calls=(call,))
            run_tool_calls({"hang": HANG_A_DAY}, turn)
        if self.mode == "many_calls":
            observations, info = run_tool_calls({"hang": HANG_BRIEFLY}, turn)
            _record_threads()
            return StepResult(tuple(observations), info=info)
        if self.mode == "big_observation":
            return StepResult(({"role": "user", "content": "x" * 10_000_000},), reward=0.5)
        return StepResult(reward=1.0, done=True)


class HostileEnvironment(Environment):
    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(options)
        self.mode = str(self.options.get("mode", ""))
        if self.mode not in MODES:
            raise ValueError(f"hostile: episode.options.mode must be one of {MODES}")

    def tools(self) -> Sequence[Mapping[str, Any]]:
        return [HANG_A_DAY.schema()]

    def episode(self, task: Task) -> Episode:
        return HostileEpisode(self.mode)

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        if self.mode == "broken_tasks":
            raise RuntimeError("the task server\nis down")
        return [{"k": k} for k in range(count)]


class ThousandCalls:
    """A tool parser that reads 1,000 calls into every turn, whatever the model wrote."""

    name = "thousand"

    def parse(self, text: str) -> ParsedTurn:
        calls = tuple(ToolCall(id=f"call_{k}", name="hang", arguments={}) for k in range(1000))
        return ParsedTurn(text, calls, ())

    def format(self, calls: Sequence[ToolCall]) -> str:
        return ""


HOSTILE = PluginSpec(
    name="hostile",
    factory="hostile_env:HostileEnvironment",
    api=">=0.1,<0.2",
    install_hint="tests/hostile_env",
    description="attacks the trainer (tests only)",
)
