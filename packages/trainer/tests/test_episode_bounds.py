"""What a model or an environment can make an episode cost is bounded and counted."""

from __future__ import annotations

import math

import pytest

from drivetrain.api.environment import AssistantTurn, ToolCall
from drivetrain.runtime.tool_calls import CUT_MARKER
from drivetrain.trainer.agentic.bounds import (
    EpisodeBounds,
    cut_observations,
    limit_calls,
    step_info,
)


def turn(calls: int, errors: int = 0) -> AssistantTurn:
    made = tuple(ToolCall(id=f"call_{k}", name="t", arguments={}) for k in range(calls))
    return AssistantTurn(0, "", "", made, tuple(f"bad {k}" for k in range(errors)))


def test_calls_beyond_the_bound_are_answered_by_one_error_line():
    kept, dropped = limit_calls(turn(1000), 16)
    assert dropped == 984 and len(kept.tool_calls) == 16
    assert kept.call_errors == (
        "984 more tool calls in this turn were not run: at most 16 a turn (episode.max_tool_calls)",
    )
    mixed, dropped = limit_calls(turn(3, errors=5), 4)
    assert (len(mixed.tool_calls), mixed.call_errors[:1], dropped) == (3, ("bad 0",), 4)
    same = turn(2, errors=2)
    assert limit_calls(same, 4) == (same, 0)


def test_observations_are_cut_in_total_and_counted():
    messages = [
        {"role": "tool", "content": "a" * 10},
        {"role": "user", "content": [{"type": "text", "text": "b" * 10}, {"type": "image"}]},
        {"role": "user", "content": "c" * 10},
    ]
    out, cut = cut_observations(messages, 15)
    assert out[0] == messages[0]
    assert out[1]["content"] == [{"type": "text", "text": "b" * 5 + CUT_MARKER}, {"type": "image"}]
    assert out[2]["content"] == CUT_MARKER and cut == 15
    assert cut_observations(messages, 30) == (messages, 0)


def test_info_keeps_its_first_keys_as_finite_numbers():
    import numpy as np

    info, dropped = step_info({"a": 1, "b": np.float32(2.5), "c": True, "d": 4}, 3)
    assert (info, dropped) == ({"a": 1.0, "b": 2.5, "c": 1.0}, 1)
    with pytest.raises(ValueError, match=r"info\['x'\] must be a number, got str"):
        step_info({"x": "10 MB of text"}, 8)
    assert step_info({"y": math.inf, "z": math.nan, "w": 2}, 8) == ({"w": 2.0}, 2)


def test_bounds_refuse_nonsense():
    with pytest.raises(ValueError):
        EpisodeBounds(max_tool_calls=0)
