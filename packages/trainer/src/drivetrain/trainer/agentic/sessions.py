"""One agent's conversations, recorded as token ids server-side, turn by turn.

An OpenAI-style agent sends its whole conversation with every request. The first request of a
session is rendered whole (:meth:`ChatTokens.prompt`); a later request whose messages begin with
the conversation recorded so far (its messages and the assistant message the server returned)
continues the same trajectory: only the messages after that prefix are rendered, as observation
tokens appended after the sampled ids (:meth:`ChatTokens.observation`), so the history is never
tokenised again. A request that does not extend the conversation (the agent edited, cut or
summarised its history, or changed its tools) starts a new :class:`Segment` of the session; each
segment is one training sample.

Messages are compared after normalising: role, content (``None`` and ``""`` alike, text parts
joined) and tool calls as ``(name, parsed arguments)``; ids and other fields do not count.

A session's requests run one at a time (:attr:`Session.lock`): a request sees the state its
predecessor left.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api import Completion, FinishReason, SamplingParams
from drivetrain.api.environment import Task
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits
from drivetrain.trainer.agentic.growing import GrowingTrajectory
from drivetrain.trainer.agentic.tool_parsers import ParsedTurn

#: a message as compared: role, content, ((tool name, arguments as JSON), ...)
Normal = tuple[str, str, tuple[tuple[str, str], ...]]


class RequestError(ValueError):
    """A request the server refuses (HTTP 400): ``code`` is OpenAI's error code, if any."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, ``None``, or OpenAI text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise RequestError(f"{where}: only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}: a text part needs a string 'text'")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string, null or a list of text parts")


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as a value: OpenAI sends a JSON string; anything unreadable stays."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _calls(message: Mapping[str, Any], where: str) -> list[tuple[str, Any]]:
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RequestError(f"{where}: tool_calls must be a list")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(f"{where}: tool call {k} needs function.name")
        out.append((function["name"], _arguments(function.get("arguments", {}))))
    return out


def check_messages(messages: Any) -> list[Mapping[str, Any]]:
    """The request's ``messages``, checked to be a non-empty list of messages with roles."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a string 'role'")
        _text(message.get("content"), f"messages[{i}]")
        _calls(message, f"messages[{i}]")
    return messages


def normalise(message: Mapping[str, Any]) -> Normal:
    """What of a message decides whether a conversation extends another."""
    calls = tuple(
        (name, json.dumps(arguments, sort_keys=True)) for name, arguments in _calls(message, "")
    )
    return (message["role"], _text(message.get("content"), ""), calls)


def for_template(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as chat templates take it: text content, tool-call arguments as objects."""
    out: dict[str, Any] = {"role": message["role"], "content": _text(message.get("content"), "")}
    for key in ("name", "tool_call_id"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for call, (name, arguments) in zip(calls, _calls(message, ""), strict=True)
        ]
    return out


@dataclass(kw_only=True)
class Segment(GrowingTrajectory):
    """One trajectory of a session, grown turn by turn, and the conversation it records."""

    chat: ChatTokens
    tools_key: str
    messages: list[Normal] = field(default_factory=list)  # the conversation so far
    last_sampled: list[int] = field(default_factory=list)
    last_text: str = ""  # the last assistant turn as the model wrote it (decoded)
    truncation: str = ""  # why the server refused the turn after the last, if it did
    tool_calls: int = 0
    call_errors: int = 0


@dataclass(frozen=True)
class Turn:
    """A request's plan: the prompt ids to generate after and how many tokens it may sample
    (``bound``: what bounds that, when not the turn budget); ``segment`` is the one it
    continues (``None``: a new segment starting at ``prompt``)."""

    prompt_ids: tuple[int, ...]
    budget: int
    bound: str
    segment: Segment | None
    observation: tuple[int, ...]
    messages: tuple[Normal, ...]
    chat: ChatTokens
    tools_key: str


@dataclass
class Session:
    """An episode the agent plays: task ``task`` (an index into the play's tasks), sample
    ``sample`` of it, generated on replica ``replica``."""

    sid: str
    number: int  # k: the play's episode k (task k // n, sample k % n)
    task: int
    sample: int
    replica: int
    task_data: Task
    limits: EpisodeLimits
    params: SamplingParams  # the play's sampling (the request's own are ignored)
    segments: list[Segment] = field(default_factory=list)
    reward: float | None = None  # reported by the agent
    requests: int = 0  # chat requests answered (each a turn)
    closed: bool = False
    running: str | None = None  # the id of the request generating now
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        max_tokens: int | None,
        chat_for: Callable[[Sequence[Mapping[str, Any]]], ChatTokens],
    ) -> Turn:
        """How to answer ``messages``: continue the last segment or start one. Raises
        :class:`RequestError` when the limits leave the turn no room (recorded as the
        segment's truncation)."""
        normal = [normalise(m) for m in messages]
        tools_key = json.dumps(list(tools), sort_keys=True)
        last = self.segments[-1] if self.segments else None
        limits = self.limits
        if (
            last is not None
            and last.tools_key == tools_key
            and len(normal) > len(last.messages)
            and normal[: len(last.messages)] == last.messages
        ):
            if len(last.turn_ends) >= limits.max_turns:
                last.truncation = "max_turns"
                raise RequestError(
                    f"this episode has had its {limits.max_turns} turns", "max_turns_exceeded"
                )
            new = [for_template(m) for m in messages[len(last.messages) :]]
            observation = last.chat.observation(new, last.last_sampled)
            prompt = [*last.prompt, *last.tokens, *observation]
            used = len(last.tokens) + len(observation)
            budget, why = limits.budget(len(last.prompt), used, max_tokens or 0)
            if budget < 1:
                last.truncation = why
                raise RequestError(
                    f"no room for another turn ({why}: {len(prompt)} prompt tokens)",
                    "context_length_exceeded",
                )
            return Turn(
                tuple(prompt),
                budget,
                why,
                last,
                tuple(observation),
                tuple(normal),
                last.chat,
                tools_key,
            )
        chat = chat_for(tools)
        prompt = chat.prompt([for_template(m) for m in messages])
        budget, why = limits.budget(len(prompt), 0, max_tokens or 0)
        if budget < 1:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens: no room left in the context of "
                f"{limits.context}",
                "context_length_exceeded",
            )
        return Turn(tuple(prompt), budget, why, None, (), tuple(normal), chat, tools_key)

    def record(
        self, turn: Turn, completion: Completion, text: str, parsed: ParsedTurn
    ) -> dict[str, Any]:
        """Append a finished turn (``completion`` sampled after ``turn.prompt_ids``) and return
        the assistant message the server answers with, which the conversation now ends with."""
        segment = turn.segment
        if segment is None:
            segment = Segment(
                chat=turn.chat, tools_key=turn.tools_key, prompt=list(turn.prompt_ids)
            )
            self.segments.append(segment)
        elif turn.observation:
            segment.add_observation(turn.observation)
        segment.add_turn(completion)
        segment.last_sampled = list(completion.token_ids)
        segment.last_text = text
        # a turn cut by the episode's room, not its own budget, ends the episode
        cut = completion.finish_reason is FinishReason.LENGTH and turn.bound
        segment.truncation = turn.bound if cut else ""
        segment.tool_calls += len(parsed.tool_calls)
        segment.call_errors += len(parsed.errors)
        self.requests += 1
        message = assistant_message(self, parsed)
        segment.messages = [*turn.messages, normalise(message)]
        return message


def assistant_message(session: Session, parsed: ParsedTurn) -> dict[str, Any]:
    """The OpenAI assistant message of a parsed turn: ``content`` without the tool-call markup
    (``None`` when empty and there are calls), ``tool_calls`` with arguments as JSON strings and
    ids unique in the session; calls that could not be parsed in ``tool_call_errors`` (not an
    OpenAI field: an agent may show them to the model)."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [
            {
                "id": f"call_{session.requests}_{k}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": json.dumps(dict(call.arguments), ensure_ascii=False),
                },
            }
            for k, call in enumerate(parsed.tool_calls)
        ]
    if parsed.errors:
        message["tool_call_errors"] = list(parsed.errors)
    return message
