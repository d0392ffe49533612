"""Running a turn's tool calls: results as observations, everything the model can get wrong as
an ``error: ...`` observation (never an exception), timeouts, cut results and the metrics."""

from __future__ import annotations

import threading
import time

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.tools import Tool
from drivetrain.runtime.tool_calls import CUT_MARKER, check_arguments, run_tool_calls


def _add(a: int, b: int) -> int:
    return a + b


ADD = Tool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    _add,
)


def _echo(**kwargs):
    return kwargs.get("text", "")


ECHO = Tool(
    "echo",
    "Say it back.",
    {
        "type": "object",
        "properties": {
            "text": {"type": "string"},
            "ratio": {"type": "number"},
            "flag": {"type": "boolean"},
            "items": {"type": "array"},
            "opts": {"type": "object"},
            "maybe": {"type": ["string", "null"]},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
        },
    },
    _echo,
)


def _fail(**kwargs):
    raise ValueError("boom")


FAIL = Tool("fail", "Always fails.", {"type": "object", "properties": {}}, _fail)
TOOLS = {t.name: t for t in (ADD, ECHO, FAIL)}


def _turn(*calls: ToolCall, errors: tuple[str, ...] = ()) -> AssistantTurn:
    return AssistantTurn(index=0, text="", content="", tool_calls=calls, call_errors=errors)


def _run(*calls: ToolCall, tools=TOOLS, **kwargs):
    return run_tool_calls(tools, _turn(*calls), **kwargs)


def test_schema_is_the_openai_function_format():
    assert ADD.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": dict(ADD.parameters),
        },
    }


def test_results_become_tool_messages_in_order():
    obs, metrics = _run(
        ToolCall("add", {"a": 2, "b": 3}, "call_0"),
        ToolCall("echo", {"text": "hi"}, "call_1"),
    )
    assert obs == [
        {"role": "tool", "name": "add", "tool_call_id": "call_0", "content": "5"},
        {"role": "tool", "name": "echo", "tool_call_id": "call_1", "content": "hi"},
    ]
    assert metrics == {"tools/calls": 2.0, "tools/succeeded": 2.0, "tools/failed": 0.0}


def test_non_string_results_are_json_and_unserialisable_ones_str():
    tools = {
        "data": Tool("data", "", {}, lambda: {"x": [1, "é"], "y": None}),
        "obj": Tool("obj", "", {}, _Shown),
        "set": Tool("set", "", {}, lambda: {3}),
    }
    obs, _ = _run(ToolCall("data", {}), ToolCall("obj", {}), ToolCall("set", {}), tools=tools)
    assert [o["content"] for o in obs] == ['{"x": [1, "é"], "y": null}', "shown", "{3}"]


class _Shown:
    def __str__(self) -> str:
        return "shown"


def test_unknown_tool():
    obs, metrics = _run(ToolCall("mul", {}, "call_0"))
    assert obs[0]["content"] == "error: unknown tool 'mul'; tools: add, echo, fail"
    assert obs[0]["name"] == "mul" and obs[0]["tool_call_id"] == "call_0"
    assert metrics == {"tools/calls": 1.0, "tools/succeeded": 0.0, "tools/failed": 1.0}
    assert (
        _run(ToolCall("x", {}), tools={})[0][0]["content"] == "error: unknown tool 'x'; tools: none"
    )


@pytest.mark.parametrize(
    ("tool", "arguments", "error"),
    [
        ("add", {"a": 1}, "tool 'add': missing required argument 'b'"),
        ("add", {"a": 1, "b": 2, "c": 3}, "tool 'add': unexpected argument 'c' (accepts a, b)"),
        ("add", {"a": "1", "b": 2}, "tool 'add': argument 'a' must be integer, got string"),
        ("add", {"a": 1.5, "b": 2}, "tool 'add': argument 'a' must be integer, got number"),
        ("add", {"a": True, "b": 2}, "tool 'add': argument 'a' must be integer, got boolean"),
        ("echo", {"text": 3}, "tool 'echo': argument 'text' must be string, got number"),
        ("echo", {"ratio": "x"}, "tool 'echo': argument 'ratio' must be number, got string"),
        ("echo", {"ratio": False}, "tool 'echo': argument 'ratio' must be number, got boolean"),
        ("echo", {"flag": 1}, "tool 'echo': argument 'flag' must be boolean, got number"),
        ("echo", {"items": {}}, "tool 'echo': argument 'items' must be array, got object"),
        ("echo", {"opts": []}, "tool 'echo': argument 'opts' must be object, got array"),
        ("echo", {"maybe": 1}, "tool 'echo': argument 'maybe' must be string or null, got number"),
        ("echo", {"mode": "warp"}, "tool 'echo': argument 'mode' must be one of ['fast', 'slow']"),
    ],
)
def test_arguments_that_do_not_fit_the_schema(tool, arguments, error):
    obs, metrics = _run(ToolCall(tool, arguments, "call_0"))
    assert obs[0]["content"] == f"error: {error}"
    assert metrics["tools/failed"] == 1.0


def test_arguments_that_fit():
    fine = {
        "text": "t",
        "ratio": 1,
        "flag": True,
        "items": [1],
        "opts": {},
        "maybe": None,
        "mode": "fast",
    }
    assert check_arguments(ECHO, fine) is None
    assert check_arguments(ECHO, {"extra": 1}) is None  # additionalProperties not false
    assert check_arguments(ADD, [1, 2]) == "tool 'add': arguments must be a JSON object"


def test_a_raising_tool_is_an_error_observation():
    obs, metrics = _run(ToolCall("fail", {}, "call_0"), ToolCall("add", {"a": 1, "b": 1}, "call_1"))
    assert [o["content"] for o in obs] == ["error: ValueError: boom", "2"]
    assert metrics == {"tools/calls": 2.0, "tools/succeeded": 1.0, "tools/failed": 1.0}


def test_a_tool_rejecting_its_keywords_is_an_error_observation():
    tools = {"two": Tool("two", "", {}, lambda a: a)}
    (obs,), _ = _run(ToolCall("two", {"b": 1}), tools=tools)
    assert obs["content"].startswith("error: TypeError: ")


@pytest.mark.timeout(10)
def test_a_hanging_tool_times_out_and_is_left_behind():
    release = threading.Event()
    started = time.monotonic()
    tools = {
        "hang": Tool("hang", "", {}, lambda: release.wait(30), timeout_s=0.2),
        "add": ADD,
    }
    try:
        obs, metrics = _run(
            ToolCall("hang", {}, "call_0"), ToolCall("add", {"a": 1, "b": 2}, "call_1"), tools=tools
        )
    finally:
        release.set()
    assert time.monotonic() - started < 5
    assert [o["content"] for o in obs] == ["error: tool 'hang' timed out after 0.2 s", "3"]
    assert metrics == {"tools/calls": 2.0, "tools/succeeded": 1.0, "tools/failed": 1.0}
    abandoned = [t for t in threading.enumerate() if t.name == "tool-hang"]
    assert all(t.daemon for t in abandoned)
    for thread in abandoned:
        thread.join(5)


def test_long_results_and_errors_are_cut():
    tools = {
        "big": Tool("big", "", {}, lambda: "x" * 5000),
        "loud": Tool("loud", "", {}, lambda: (_ for _ in ()).throw(RuntimeError("y" * 5000))),
    }
    obs, _ = _run(ToolCall("big", {}), ToolCall("loud", {}), tools=tools)
    assert obs[0]["content"] == "x" * 2000 + CUT_MARKER
    assert obs[1]["content"].startswith("error: RuntimeError: yyy") and obs[1]["content"].endswith(
        CUT_MARKER
    )
    assert len(obs[1]["content"]) == 2000 + len(CUT_MARKER)
    (small,), _ = _run(ToolCall("big", {}), tools=tools, max_chars=10)
    assert small["content"] == "x" * 10 + CUT_MARKER
    (exact,), _ = _run(ToolCall("big", {}), tools=tools, max_chars=5000)
    assert exact["content"] == "x" * 5000
    with pytest.raises(ValueError, match="max_chars"):
        _run(ToolCall("big", {}), tools=tools, max_chars=0)


def test_parse_errors_follow_the_calls_and_count_as_failed_calls():
    turn = _turn(
        ToolCall("add", {"a": 1, "b": 1}, "call_0"), errors=("tool call 1: malformed JSON: x",)
    )
    obs, metrics = run_tool_calls(TOOLS, turn)
    assert obs[1] == {
        "role": "tool",
        "name": "",
        "tool_call_id": "",
        "content": "error: tool call 1: malformed JSON: x",
    }
    assert metrics == {"tools/calls": 2.0, "tools/succeeded": 1.0, "tools/failed": 1.0}


def test_no_calls_no_observations():
    assert run_tool_calls(TOOLS, _turn()) == (
        [],
        {"tools/calls": 0.0, "tools/succeeded": 0.0, "tools/failed": 0.0},
    )
