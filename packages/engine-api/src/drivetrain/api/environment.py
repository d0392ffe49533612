"""The environment contract: multi-turn episodes an agent (the policy) plays, with tools.

An :class:`Environment` is a plugin (entry-point group ``drivetrain.environments``, a
:class:`~drivetrain.api.plugin.PluginSpec` whose factory is the subclass, listed by
``drivetrain environments`` and imported only when a job selects it). The trainer makes one
:class:`Episode` per task and sample and plays many at once:

1. :meth:`Episode.reset` gives the first messages (OpenAI-style chat messages: ``role``,
   ``content``); the trainer renders them with the tokenizer's chat template and the
   environment's :meth:`Environment.tools` (JSON schemas).
2. The policy samples an assistant turn; the trainer parses its tool calls
   (:mod:`drivetrain.trainer.agentic.tool_parsers`) and calls :meth:`Episode.step` with the
   :class:`AssistantTurn`.
3. The :class:`StepResult` holds observation messages (tool results: appended to the
   conversation as prompt tokens, never trained on), this turn's reward, and ``done``.
4. An episode the trainer cuts short (most turns, a token budget, the context) is told why
   through :meth:`Episode.truncated`, which may give a last reward.

An episode's reward is the sum of its turns' rewards (and the truncation reward). ``step``
runs in a worker thread of the trainer: episodes of one environment object may step at the
same time, so state shared between episodes needs a lock. Standard library only, like every
contract here: environments are plain Python.

Optional: :meth:`Environment.demonstration`, an expert's turns for a task (the kit's harness
solution by default); then ``drivetrain grpo env=NAME`` needs no model: it warms a tiny one up
on the demonstrations that earn a reward (played through ``reset``/``step``), then runs GRPO.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: An OpenAI-style chat message: ``role`` and ``content``, and for tool use ``tool_calls``
#: (assistant), ``tool_call_id`` and ``name`` (tool results).
Message = Mapping[str, Any]
#: A task: what one episode is about (a dataset row, or what :meth:`Environment.tasks` made).
Task = Mapping[str, Any]

#: Why the trainer ended an episode (metrics ``episode/truncated/<reason>``).
TRUNCATION_REASONS = ("max_turns", "turn_tokens", "episode_tokens", "context")


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call: the tool's ``name`` and its ``arguments`` (a JSON object)."""

    name: str
    arguments: Mapping[str, Any]
    id: str = ""


@dataclass(frozen=True)
class AssistantTurn:
    """One sampled assistant turn as the environment sees it.

    ``text`` is the decoded turn (end-of-turn token removed); ``content`` the text without the
    tool-call markup; ``tool_calls`` the well-formed calls, in order; ``call_errors`` one line
    per call that could not be parsed (malformed JSON, no name...). ``finished``: the turn
    ended by itself (end of turn, a stop token), not at its token budget.
    """

    index: int  # 0 for the first turn of the episode
    text: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    call_errors: tuple[str, ...] = ()
    finished: bool = True


@dataclass(frozen=True)
class StepResult:
    """What follows an assistant turn: observation messages (the next turn's prompt), this
    turn's reward, whether the episode is over, and ``info``: numbers for the metrics, summed
    over an episode's turns, then averaged over a step's episodes as ``env/<key>`` (a key
    counted once a turn reads as "per episode"; ``tools/calls``, ``tools/succeeded`` are
    standard and become ``tools/calls_per_episode`` and ``tools/success_rate``: see
    :func:`drivetrain.runtime.tool_calls.run_tool_calls`)."""

    observations: tuple[Message, ...] = ()
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.done and not self.observations:
            raise ValueError("an episode that goes on needs observation messages")


class Episode(abc.ABC):
    """One play of a task (see the module docstring)."""

    @abc.abstractmethod
    def reset(self) -> Sequence[Message]:
        """The first messages (system and user turns), before the first assistant turn."""

    @abc.abstractmethod
    def step(self, turn: AssistantTurn) -> StepResult:
        """React to the assistant's turn. Must not raise for anything the policy wrote: a bad
        tool call is an error observation (:func:`drivetrain.runtime.tool_calls.run_tool_calls`)."""

    def truncated(self, reason: str) -> float:
        """The trainer ended the episode before ``done`` (one of ``TRUNCATION_REASONS``);
        returns a last reward, 0 by default."""
        return 0.0


class Environment(abc.ABC):
    """A task family with its tools; builds episodes. ``options`` are the job's
    ``episode.options`` (plain values from the config: ``drivetrain grpo env=NAME
    episode.options.KEY=VALUE``), validated by the environment: raise ``ValueError`` with one
    line naming the option, and the job fails before any worker starts."""

    def __init__(self, options: Mapping[str, Any] | None = None) -> None:
        self.options = dict(options or {})

    def tools(self) -> Sequence[Mapping[str, Any]]:
        """The tools' JSON schemas, OpenAI function format (``{"type": "function",
        "function": {"name", "description", "parameters"}}``), passed to the chat template;
        none by default."""
        return ()

    @abc.abstractmethod
    def episode(self, task: Task) -> Episode:
        """A new episode of ``task``; many may be in flight at once."""

    def demonstration(self, task: Task) -> Sequence[AssistantTurn] | None:
        """Turns of an episode of ``task`` that ends (``done``) at the last with a reward > 0,
        as :meth:`Episode.step` takes them (``text`` may be empty: the trainer writes
        ``content`` and ``tool_calls`` in its model's markup); the same for a task (the warm
        start is cached by their hash). ``None`` (the default): it cannot demonstrate."""
        return None

    def tasks(self, split: str, count: int, seed: int) -> list[Task]:
        """``count`` tasks of ``split`` (``train`` or ``val``), made from ``seed``: for an
        environment that needs no dataset. Others raise, and the job needs
        ``data.train_path`` (each row is a task)."""
        raise NotImplementedError(
            f"environment {type(self).__name__} makes no tasks of its own: set data.train_path"
        )
