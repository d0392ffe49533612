"""Bounds on what a model or an environment can make an episode do, applied before the
trainer spends anything on it: call attempts per turn (a model may write a thousand),
observation text and ``info`` entries per step (an environment may return megabytes, which
tokenising would turn into seconds and gigabytes). What is cut is counted, so the metrics say
it happened (``episode/cut/...``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from drivetrain.api.environment import AssistantTurn, Message
from drivetrain.runtime.tool_calls import CUT_MARKER

#: the counters this module adds to an episode's info (summed, then averaged per episode)
CUT_PREFIX = "episode/cut/"
CUT_TOOL_CALLS = "episode/cut/tool_calls"
CUT_OBSERVATION_CHARS = "episode/cut/observation_chars"
CUT_INFO_ENTRIES = "episode/cut/info_entries"


@dataclass(frozen=True)
class EpisodeBounds:
    """``max_tool_calls`` call attempts a turn; ``observation_chars`` characters of text a
    step's observations carry in all; ``info_keys`` entries of a step's ``info``."""

    max_tool_calls: int = 16
    observation_chars: int = 16_000
    info_keys: int = 64

    def __post_init__(self) -> None:
        if min(self.max_tool_calls, self.observation_chars, self.info_keys) < 1:
            raise ValueError(f"invalid episode bounds {self}")


def limit_calls(turn: AssistantTurn, max_calls: int) -> tuple[AssistantTurn, int]:
    """``turn`` with at most ``max_calls`` call attempts (well-formed calls first, then
    unparsable ones), and how many were dropped; the dropped are answered by one error line
    that the policy reads, as it reads any bad call."""
    attempts = len(turn.tool_calls) + len(turn.call_errors)
    if attempts <= max_calls:
        return turn, 0
    calls = turn.tool_calls[:max_calls]
    errors = turn.call_errors[: max_calls - len(calls)]
    dropped = attempts - len(calls) - len(errors)
    note = (
        f"{dropped} more tool calls in this turn were not run: at most {max_calls} a turn "
        "(episode.max_tool_calls)"
    )
    return replace(turn, tool_calls=calls, call_errors=(*errors, note)), dropped


def cut_observations(messages: Sequence[Message], max_chars: int) -> tuple[list[Message], int]:
    """``messages`` whose text contents (a string, or a list of parts with ``text``) keep at
    most ``max_chars`` characters in all, in order (a cut text ends with ``CUT_MARKER``); and
    how many characters were cut."""
    left, cut = max_chars, 0
    out: list[Message] = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            text, left, dropped = _cut(content, left)
            out.append({**message, "content": text} if dropped else message)
            cut += dropped
        elif isinstance(content, list):
            parts: list[Any] = []
            for part in content:
                text = part.get("text") if isinstance(part, Mapping) else None
                if isinstance(text, str):
                    kept, left, dropped = _cut(text, left)
                    part = {**part, "text": kept} if dropped else part
                    cut += dropped
                parts.append(part)
            out.append({**message, "content": parts})
        else:
            out.append(message)
    return out, cut


def _cut(text: str, left: int) -> tuple[str, int, int]:
    """(the kept text, characters left after it, characters cut)."""
    if len(text) <= left:
        return text, left - len(text), 0
    return text[:left] + CUT_MARKER, 0, len(text) - left


def step_info(info: Mapping[str, Any], max_keys: int) -> tuple[dict[str, float], int]:
    """The first ``max_keys`` entries of a step's ``info`` with finite values, as floats, and
    how many entries were dropped (past the bound, or NaN and infinities: a metric's mean is
    no place for them). A value that is not a number raises ``ValueError`` naming its key
    (the environment's bug)."""
    out: dict[str, float] = {}
    for key, value in list(info.items())[:max_keys]:
        try:  # numpy and torch scalars are numbers too; a string is not
            if isinstance(value, (str, bytes)):
                raise TypeError
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"info[{str(key)!r}] must be a number, got {type(value).__name__}"
            ) from None
        if math.isfinite(number):
            out[str(key)] = number
    return out, len(info) - len(out)
