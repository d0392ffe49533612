"""Tool-call parsers: from a sampled assistant turn's text to its tool calls, and back.

Each model family writes tool calls in its own markup, so the parser is chosen per model
(``tool_parser(name)``): the built-ins ``hermes`` (Hermes, Qwen) and ``llama3_json`` (Llama
3.1/3.2 JSON tool calling), else a plugin of the entry-point group ``drivetrain.tool_parsers``
whose value names a :class:`ToolParser` instance or class. Only the selected entry point is
imported.

A parser never raises for what the model wrote: a call it cannot read becomes one line of
``errors``, which the environment turns into an error observation, so the policy learns from a
malformed call instead of the episode crashing. ``format`` is the inverse of ``parse``, used to
write SFT demonstrations in the markup the policy will be parsed with.

Calls get the id ``call_<k>``, ``k`` being the call's position among the turn's call attempts
(malformed ones included), so an id says where in the turn the call was, whatever failed
around it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.errors import PluginError

ENTRY_POINT_GROUP = "drivetrain.tool_parsers"


@dataclass(frozen=True)
class ParsedTurn:
    """A turn's text outside the call markup, its well-formed calls in order, and one line per
    call that could not be parsed."""

    content: str
    tool_calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]


@runtime_checkable
class ToolParser(Protocol):
    """Reads one model family's tool-call markup (``parse``) and writes it (``format``)."""

    name: str

    def parse(self, text: str) -> ParsedTurn: ...

    def format(self, calls: Sequence[ToolCall]) -> str: ...


def _json_name(value: Any) -> str:
    """A decoded JSON value's type in JSON's words (what the model wrote, not Python's)."""
    if isinstance(value, bool):
        return "boolean"
    names = {list: "array", str: "string", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _make_call(obj: Any, k: int, args_keys: tuple[str, ...]) -> ToolCall | str:
    """The call a decoded JSON value describes, or why it describes none (one line).

    ``args_keys`` are the keys that may hold the arguments, first found wins; arguments given
    as a JSON string (the OpenAI style) are decoded, missing ones are ``{}``.
    """
    if not isinstance(obj, dict):
        return f"tool call {k}: expected a JSON object, got {_json_name(obj)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call {k}: missing or non-string 'name'"
    key = next((key for key in args_keys if key in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except _JSON_ERRORS as exc:
            return f"tool call {k} ({name}): '{key}' is a string but not JSON: {exc}"
    if not isinstance(arguments, dict):
        return f"tool call {k} ({name}): '{key}' must be a JSON object"
    call_id = obj.get("id")
    return ToolCall(
        name, arguments, call_id if isinstance(call_id, str) and call_id else f"call_{k}"
    )


#: what ``json`` raises on text a model wrote: malformed JSON, but also an integer of more
#: digits than Python converts (ValueError) and nesting deeper than the recursion limit
_JSON_ERRORS = (ValueError, RecursionError)


def _first_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


def _collect(results: Sequence[ToolCall | str]) -> tuple[tuple[ToolCall, ...], tuple[str, ...]]:
    calls = tuple(r for r in results if isinstance(r, ToolCall))
    return calls, tuple(r for r in results if isinstance(r, str))


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number per turn, with
    text around them (Hermes 2/3, Qwen 2.5/3, and the many models trained on their template)."""

    name = "hermes"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        results: list[ToolCall | str] = []
        outside: list[str] = []
        pos = 0
        for match in self._CALL.finditer(text):
            outside.append(text[pos : match.start()])
            pos = match.end()
            k = len(results)
            try:
                obj = json.loads(match.group(1))
            except _JSON_ERRORS as exc:
                results.append(f"tool call {k}: malformed JSON: {_first_line(exc)}")
                continue
            results.append(_make_call(obj, k, ("arguments",)))
        rest = text[pos:]
        cut = rest.find(self._OPEN)
        if cut >= 0:  # an opening tag never closed: the turn hit its token budget mid-call
            results.append(f"tool call {len(results)}: <tool_call> without </tool_call>")
            rest = rest[:cut]
        outside.append(rest)
        calls, errors = _collect(results)
        return ParsedTurn("".join(outside).strip(), calls, errors)

    def format(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            "<tool_call>"
            + json.dumps(
                {"name": c.name, "arguments": dict(c.arguments)},
                separators=(",", ":"),
                ensure_ascii=False,
            )
            + "</tool_call>"
            for c in calls
        )


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip())


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON tool calling, as vLLM's ``llama3_json`` parser reads it: the turn
    (optionally after ``<|python_tag|>``) is ``{"name": ..., "parameters": {...}}`` objects
    separated by ``;``. A turn not starting with ``{`` is plain text; text after the last
    object is content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.lstrip()
        body = body.removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return ParsedTurn(body.strip(), (), ())
        decoder = json.JSONDecoder()
        results: list[ToolCall | str] = []
        pos = 0
        while pos < len(body):
            k = len(results)
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except _JSON_ERRORS as exc:  # nothing after this can be trusted
                results.append(f"tool call {k}: malformed JSON: {_first_line(exc)}")
                pos = len(body)
                break
            results.append(_make_call(obj, k, ("parameters", "arguments")))
            pos = _skip_space(body, pos)
            if not body.startswith(";", pos):
                break
            pos = _skip_space(body, pos + 1)
        calls, errors = _collect(results)
        return ParsedTurn(body[pos:].strip(), calls, errors)

    def format(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(
            json.dumps({"name": c.name, "parameters": dict(c.arguments)}, ensure_ascii=False)
            for c in calls
        )


BUILTIN_PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def tool_parser(name: str) -> ToolParser:
    """The parser called ``name``: a built-in, else the entry point of that name in
    ``drivetrain.tool_parsers`` (an instance, or a class made with no arguments)."""
    if name in BUILTIN_PARSERS:
        return BUILTIN_PARSERS[name]
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    if name not in found:
        known = ", ".join(sorted({*BUILTIN_PARSERS, *found}))
        raise ValueError(f"unknown tool parser {name!r}; known: {known}")
    try:
        target = found[name].load()
        parser = target() if isinstance(target, type) else target
    except Exception as exc:
        raise PluginError(
            f"tool parser {name!r} ({found[name].value}) failed to load: {exc}"
        ) from exc
    if not isinstance(parser, ToolParser):
        raise PluginError(
            f"tool parser {name!r} ({found[name].value}) is not a ToolParser"
            " (needs name, parse and format)"
        )
    return parser


def parse_turn(parser: ToolParser, index: int, text: str, *, finished: bool) -> AssistantTurn:
    """The :class:`AssistantTurn` an environment steps on: ``text`` parsed by ``parser``."""
    parsed = parser.parse(text)
    return AssistantTurn(
        index=index,
        text=text,
        content=parsed.content,
        tool_calls=parsed.tool_calls,
        call_errors=parsed.errors,
        finished=finished,
    )
