"""Tool-call parsers: both built-in formats, malformed calls as error lines, round trips, and
finding a parser by name (entry points included)."""

from __future__ import annotations

import sys
import types
from importlib.metadata import EntryPoint

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.api.errors import PluginError
from drivetrain.trainer.agentic import tool_parsers
from drivetrain.trainer.agentic.tool_parsers import (
    BUILTIN_PARSERS,
    HermesParser,
    Llama3JsonParser,
    ParsedTurn,
    ToolParser,
    parse_turn,
    tool_parser,
)

hermes = HermesParser()
llama = Llama3JsonParser()


# --- hermes ---------------------------------------------------------------------------------


def test_hermes_one_call_with_content_around_it():
    text = (
        'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"q": "cats"}}\n</tool_call>'
        "\nDone."
    )
    parsed = hermes.parse(text)
    assert parsed == ParsedTurn(
        "Let me look.\n\nDone.", (ToolCall("search", {"q": "cats"}, "call_0"),), ()
    )


def test_hermes_several_calls_in_order():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>  {"name": "b", "arguments": {}}  </tool_call>'
    )
    parsed = hermes.parse(text)
    assert [(c.name, c.id) for c in parsed.tool_calls] == [("a", "call_0"), ("b", "call_1")]
    assert parsed.tool_calls[0].arguments == {"x": 1}
    assert parsed.content == "" and parsed.errors == ()


def test_hermes_plain_text_has_no_calls():
    assert hermes.parse("  just an answer: 42 \n") == ParsedTurn("just an answer: 42", (), ())


def test_hermes_arguments_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}</tool_call>'
    assert hermes.parse(text).tool_calls == (ToolCall("f", {"a": [1, 2]}, "call_0"),)


def test_hermes_missing_arguments_are_empty_and_an_id_given_is_kept():
    text = '<tool_call>{"name": "now", "id": "xyz"}</tool_call>'
    assert hermes.parse(text).tool_calls == (ToolCall("now", {}, "xyz"),)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "f", "arguments": {"a": 1}', "tool call 0: malformed JSON: "),
        ('["f", {"a": 1}]', "tool call 0: expected a JSON object, got array"),
        ('"f"', "tool call 0: expected a JSON object, got string"),
        ("null", "tool call 0: expected a JSON object, got null"),
        ("true", "tool call 0: expected a JSON object, got boolean"),
        ('{"arguments": {"a": 1}}', "tool call 0: missing or non-string 'name'"),
        ('{"name": 3, "arguments": {}}', "tool call 0: missing or non-string 'name'"),
        ('{"name": "f", "arguments": [1]}', "tool call 0 (f): 'arguments' must be a JSON object"),
        (
            '{"name": "f", "arguments": "{oops"}',
            "tool call 0 (f): 'arguments' is a string but not JSON",
        ),
        ('{"name": "f", "arguments": "[1]"}', "tool call 0 (f): 'arguments' must be a JSON object"),
    ],
)
def test_hermes_bad_calls_are_error_lines_not_exceptions(body, error):
    parsed = hermes.parse(f"thinking <tool_call>{body}</tool_call>")
    assert parsed.tool_calls == ()
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith(error)
    assert "\n" not in parsed.errors[0]
    assert parsed.content == "thinking"


def test_hermes_a_bad_call_does_not_hide_the_good_ones_and_ids_keep_positions():
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
        "<tool_call>{not json}</tool_call>"
        '<tool_call>{"name": "c", "arguments": {}}</tool_call>'
    )
    parsed = hermes.parse(text)
    assert [(c.name, c.id) for c in parsed.tool_calls] == [("a", "call_0"), ("c", "call_2")]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("tool call 1: malformed JSON")


def test_hermes_unclosed_call_is_an_error_and_not_content():
    text = (
        'Sure.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "argu'
    )
    parsed = hermes.parse(text)
    assert [c.name for c in parsed.tool_calls] == ["a"]
    assert parsed.errors == ("tool call 1: <tool_call> without </tool_call>",)
    assert parsed.content == "Sure."


# --- llama3_json ----------------------------------------------------------------------------


def test_llama3_one_call():
    parsed = llama.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert parsed == ParsedTurn("", (ToolCall("get_weather", {"city": "Paris"}, "call_0"),), ())


def test_llama3_python_tag_prefix_and_several_calls():
    text = (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {"y": 2}}'
    )
    parsed = llama.parse(text)
    assert parsed.tool_calls == (
        ToolCall("a", {"x": 1}, "call_0"),
        ToolCall("b", {"y": 2}, "call_1"),
    )
    assert parsed.errors == () and parsed.content == ""


def test_llama3_plain_text_is_content():
    assert llama.parse("The answer is {x}.") == ParsedTurn("The answer is {x}.", (), ())
    assert llama.parse("  <|python_tag|> print(1)") == ParsedTurn("print(1)", (), ())


def test_llama3_arguments_as_a_json_string_are_decoded():
    parsed = llama.parse('{"name": "f", "parameters": "{\\"a\\": true}"}')
    assert parsed.tool_calls == (ToolCall("f", {"a": True}, "call_0"),)


def test_llama3_malformed_json_stops_the_walk():
    parsed = llama.parse(
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {; {"name": "c"}'
    )
    assert [c.name for c in parsed.tool_calls] == ["a"]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("tool call 1: malformed JSON")


def test_llama3_a_truncated_call_is_an_error():
    parsed = llama.parse('{"name": "a", "parameters": {"q": "unfinis')
    assert parsed.tool_calls == () and parsed.errors[0].startswith("tool call 0: malformed JSON")


def test_llama3_non_object_and_nameless_values_are_errors_and_the_walk_goes_on():
    parsed = llama.parse('{"parameters": {}}; [1, 2]; {"name": "ok", "parameters": {}}')
    assert [c.id for c in parsed.tool_calls] == ["call_2"]
    assert parsed.errors == (
        "tool call 0: missing or non-string 'name'",
        "tool call 1: expected a JSON object, got array",
    )


def test_llama3_text_after_the_calls_is_content():
    parsed = llama.parse('{"name": "a", "parameters": {}}\nI called a.')
    assert [c.name for c in parsed.tool_calls] == ["a"] and parsed.content == "I called a."


# --- format: the inverse of parse -----------------------------------------------------------

CALLS = (
    ToolCall("search", {"q": "café", "limit": 3}, "call_0"),
    ToolCall("calc", {"expr": "1+1", "nested": {"a": [1, None, True]}}, "call_1"),
)


@pytest.mark.parametrize("parser", [hermes, llama], ids=lambda p: p.name)
def test_format_then_parse_gives_the_calls_back(parser):
    text = parser.format(CALLS)
    assert parser.parse(text) == ParsedTurn("", CALLS, ())
    assert parser.parse(parser.format(CALLS[:1])).tool_calls == CALLS[:1]


def test_format_writes_each_family_s_markup():
    call = [ToolCall("f", {"a": 1})]
    assert hermes.format(call) == '<tool_call>{"name":"f","arguments":{"a":1}}</tool_call>'
    assert llama.format(call * 2) == (
        '{"name": "f", "parameters": {"a": 1}}; {"name": "f", "parameters": {"a": 1}}'
    )
    assert hermes.format([]) == "" and llama.format([]) == ""


# --- finding a parser, building the turn ----------------------------------------------------


def test_builtins_by_name_and_protocol():
    assert set(BUILTIN_PARSERS) == {"hermes", "llama3_json"}
    assert tool_parser("hermes") is BUILTIN_PARSERS["hermes"]
    assert isinstance(tool_parser("llama3_json"), Llama3JsonParser)
    assert all(isinstance(p, ToolParser) for p in BUILTIN_PARSERS.values())


class _UpperParser:
    name = "upper"

    def parse(self, text: str) -> ParsedTurn:
        return ParsedTurn(text.upper(), (), ())

    def format(self, calls) -> str:
        return ""


def _entry_points(monkeypatch, **targets: str) -> None:
    eps = [
        EntryPoint(name, value, tool_parsers.ENTRY_POINT_GROUP) for name, value in targets.items()
    ]

    def fake(*, group: str):
        assert group == tool_parsers.ENTRY_POINT_GROUP
        return eps

    monkeypatch.setattr(tool_parsers, "entry_points", fake)


def test_unknown_name_lists_builtins_and_installed_entry_points(monkeypatch):
    _entry_points(monkeypatch, mine="not_imported_module_xyz:P")
    with pytest.raises(
        ValueError, match=r"^unknown tool parser 'nope'; known: hermes, llama3_json, mine$"
    ):
        tool_parser("nope")
    assert "not_imported_module_xyz" not in sys.modules


def test_an_entry_point_parser_is_found_and_only_it_is_imported(monkeypatch):
    module = types.ModuleType("fake_tool_parser_plugin")
    module.UpperParser = _UpperParser
    module.INSTANCE = _UpperParser()
    monkeypatch.setitem(sys.modules, "fake_tool_parser_plugin", module)
    _entry_points(
        monkeypatch,
        by_class="fake_tool_parser_plugin:UpperParser",
        by_instance="fake_tool_parser_plugin:INSTANCE",
        broken="not_imported_module_xyz:P",
    )
    made = tool_parser("by_class")
    assert isinstance(made, _UpperParser) and made.parse("hi").content == "HI"
    assert tool_parser("by_instance") is module.INSTANCE
    assert "not_imported_module_xyz" not in sys.modules
    with pytest.raises(
        PluginError, match=r"tool parser 'broken' \(not_imported_module_xyz:P\) failed to load"
    ):
        tool_parser("broken")


def test_an_entry_point_that_is_not_a_parser_is_refused(monkeypatch):
    module = types.ModuleType("fake_tool_parser_plugin")
    module.NOT_A_PARSER = object()
    monkeypatch.setitem(sys.modules, "fake_tool_parser_plugin", module)
    _entry_points(monkeypatch, odd="fake_tool_parser_plugin:NOT_A_PARSER")
    with pytest.raises(PluginError, match="is not a ToolParser"):
        tool_parser("odd")


def test_parse_turn_builds_the_assistant_turn():
    text = 'ok <tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>'
    turn = parse_turn(hermes, 2, text, finished=False)
    assert turn == AssistantTurn(
        index=2,
        text=text,
        content="ok",
        tool_calls=(ToolCall("a", {}, "call_0"),),
        call_errors=turn.call_errors,
        finished=False,
    )
    assert len(turn.call_errors) == 1 and turn.call_errors[0].startswith("tool call 1: malformed")


@pytest.mark.parametrize("parser", [HermesParser(), Llama3JsonParser()])
def test_degenerate_json_is_an_error_line_not_an_exception(parser):
    """What json raises besides JSONDecodeError: an integer longer than Python converts
    (ValueError) and nesting deeper than the recursion limit (RecursionError)."""
    for body in ('{"name": "f", "arguments": {"x": ' + "9" * 5000 + "}}", '{"a":' + "[" * 100_000):
        text = f"<tool_call>{body}</tool_call>" if parser.name == "hermes" else body
        parsed = parser.parse(text)
        assert not parsed.tool_calls and len(parsed.errors) == 1
        assert "malformed JSON" in parsed.errors[0]
