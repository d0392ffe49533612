"""Running a turn's tool calls (:class:`drivetrain.api.tools.Tool`) without trusting them.

Everything in a tool call was written by the model being trained, early on mostly wrong: an
unknown tool, missing or ill-typed arguments, a call that crashes the tool or never returns.
:func:`run_tool_calls` turns each of these into an ``error: ...`` observation the policy reads
on its next turn (and can learn from) instead of an exception that would end the episode, and
cuts every result to ``max_chars`` so one tool cannot fill the context.

A tool that never returns is the tool's bug, not the model's: its call times out (an error
observation) and its thread is abandoned, still running, holding one of the process's
``TOOL_SLOTS`` until it returns. Hung calls therefore cost at most ``TOOL_SLOTS`` threads
(besides the calls running within their timeouts, one per environment thread); once every slot
is held, the next call raises :class:`ToolSlotsExhausted` (the episode, and with it the run,
fails in one line) instead of starting thread after thread.

Arguments are checked against the top level of the tool's JSON schema only (required keys,
unexpected keys when ``additionalProperties`` is false, each property's JSON ``type`` and
``enum``); a tool checks anything deeper itself.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.errors import DrivetrainError
from drivetrain.api.tools import Tool

CUT_MARKER = "... [cut]"
#: abandoned tool calls (past their timeout, still running) this process keeps at most
TOOL_SLOTS = 64
_lock = threading.Lock()
_abandoned = 0  # held slots, under _lock


class ToolSlotsExhausted(DrivetrainError):
    """Every tool slot is held by a call that never returned: tools hang, not the model."""


# JSON-schema type name -> the Python types json.loads makes for it (bool is not a number).
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "number": (int, float),
    "integer": (int,),
    "boolean": (bool,),
    "array": (list, tuple),
    "object": (Mapping,),
    "null": (type(None),),
}


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    return next((t for t, py in _JSON_TYPES.items() if isinstance(value, py)), type(value).__name__)


def _fits(value: Any, wanted: str) -> bool:
    if wanted not in _JSON_TYPES:
        return True  # a type this check does not know: the tool's business
    if isinstance(value, bool) and wanted != "boolean":
        return False
    return isinstance(value, _JSON_TYPES[wanted])


def check_arguments(tool: Tool, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema (one line naming the argument), or None."""
    if not isinstance(arguments, Mapping):
        return f"tool {tool.name!r}: arguments must be a JSON object"
    properties: Mapping[str, Any] = tool.parameters.get("properties", {})
    for key in tool.parameters.get("required", ()):
        if key not in arguments:
            return f"tool {tool.name!r}: missing required argument {key!r}"
    for key, value in arguments.items():
        prop = properties.get(key)
        if prop is None:
            if tool.parameters.get("additionalProperties", True) is False:
                accepted = ", ".join(properties) or "none"
                return f"tool {tool.name!r}: unexpected argument {key!r} (accepts {accepted})"
            continue
        wanted = prop.get("type")
        options = [wanted] if isinstance(wanted, str) else list(wanted or ())
        if options and not any(_fits(value, t) for t in options):
            return (
                f"tool {tool.name!r}: argument {key!r} must be {' or '.join(options)},"
                f" got {_json_type(value)}"
            )
        if "enum" in prop and value not in prop["enum"]:
            return f"tool {tool.name!r}: argument {key!r} must be one of {list(prop['enum'])}"
    return None


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _call(tool: Tool, arguments: Mapping[str, Any]) -> tuple[bool, str]:
    """Run the tool in a daemon thread and wait at most its timeout: (succeeded, text).

    On a timeout the thread is abandoned, still running: Python cannot kill a thread, and
    waiting for it would let one hung tool stall every episode. It is a daemon so that it
    does not keep the process alive, and it holds a slot until it returns, so hung calls
    cannot pile up threads beyond ``TOOL_SLOTS``.
    """
    global _abandoned
    with _lock:
        if _abandoned >= TOOL_SLOTS:
            raise ToolSlotsExhausted(
                f"tool {tool.name!r} was not started: all {TOOL_SLOTS} tool slots are held by "
                "calls that never returned; a tool that may hang must bound its own work (a "
                "subprocess or socket timeout)"
            )
    outcome: list[tuple[bool, str]] = []
    state = {"finished": False, "abandoned": False}

    def target() -> None:
        global _abandoned
        try:
            outcome.append((True, _as_text(tool.function(**arguments))))
        except BaseException as exc:  # a tool's SystemExit is the model's doing too
            outcome.append((False, f"error: {type(exc).__name__}: {exc}"))
        finally:
            with _lock:
                state["finished"] = True
                if state["abandoned"]:  # returned at last: its slot is free again
                    _abandoned -= 1

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s)
    with _lock:
        if not state["finished"]:
            state["abandoned"] = True
            _abandoned += 1
    if not outcome:
        return False, f"error: tool {tool.name!r} timed out after {tool.timeout_s:g} s"
    return outcome[0]


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + CUT_MARKER


def _observation(name: str, call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "name": name, "tool_call_id": call_id, "content": content}


def run_one(tools: Mapping[str, Tool], call: ToolCall) -> tuple[bool, str]:
    """One call's outcome: (returned a result, the observation's text, not yet cut)."""
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return False, f"error: unknown tool {call.name!r}; tools: {known}"
    problem = check_arguments(tool, call.arguments)
    if problem:
        return False, f"error: {problem}"
    return _call(tool, dict(call.arguments))


def run_tool_calls(
    tools: Mapping[str, Tool], turn: AssistantTurn, *, max_chars: int = 2000
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """One ``tool`` observation per call of ``turn``, in order (run one after another: a
    later call may depend on an earlier one's effect), then one per unparsable call; and the
    metrics ``tools/calls``, ``tools/succeeded``, ``tools/failed``. Never raises for what the
    model wrote (only :class:`ToolSlotsExhausted`, for tools that hang); every content is cut
    to ``max_chars`` characters (plus ``CUT_MARKER``)."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    observations: list[dict[str, Any]] = []
    succeeded = 0
    for call in turn.tool_calls:
        ok, text = run_one(tools, call)
        succeeded += ok
        observations.append(_observation(call.name, call.id, _cut(text, max_chars)))
    for error in turn.call_errors:
        observations.append(_observation("", "", _cut(f"error: {error}", max_chars)))
    calls = len(turn.tool_calls) + len(turn.call_errors)
    metrics = {
        "tools/calls": float(calls),
        "tools/succeeded": float(succeeded),
        "tools/failed": float(calls - succeeded),
    }
    return observations, metrics
