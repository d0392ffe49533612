"""The environment kit against the echo test environment, and against environments that
break the contract in one way each (the kit must name each)."""

import random
import re

import pytest

from drivetrain.api.environment import AssistantTurn, StepResult
from drivetrain.testing.environment_kit import (
    EnvironmentConformance,
    EnvironmentHarness,
    run_environment_conformance,
)
from drivetrain.testing.environments import EchoEnvironment, EchoEpisode


class EchoHarness(EnvironmentHarness):
    def __init__(self, environment_class: type[EchoEnvironment] = EchoEnvironment) -> None:
        self.environment_class = environment_class

    def make_environment(self, options=None):
        return self.environment_class(options)

    def solution(self, task):
        """Echo the answer once, then say it."""
        from drivetrain.api.environment import ToolCall

        answer = str(task["answer"])
        call = ToolCall("echo", {"text": answer}, "c0")
        return [AssistantTurn(0, "", "", (call,)), AssistantTurn(1, answer, answer)]

    def bad_options(self):
        return [{"turns": 0}, {"turns": "three"}]


class TestEchoEnvironment(EnvironmentConformance):
    def harness(self):
        return EchoHarness()


class LaxOptions(EchoEnvironment):
    """Ignores options it does not know."""

    def __init__(self, options=None):
        super().__init__({k: v for k, v in (options or {}).items() if k == "turns"})


class UnseededTasks(EchoEnvironment):
    def tasks(self, split, count, seed):
        return [{"prompt": f"say {n}", "answer": str(n)} for n in random.sample(range(100), count)]


class CountsAcrossEpisodes(EchoEnvironment):
    """Tool turns are counted on the environment, not the episode."""

    shared = {"tool_turns": 0}

    def episode(self, task):
        episode = super().episode(task)
        shared = self.shared

        class Leaky(EchoEpisode):
            def step(self, turn):
                result = super().step(turn)
                if turn.tool_calls:
                    shared["tool_turns"] += 1
                    return StepResult(result.observations, result.reward + shared["tool_turns"],
                                      result.done, result.info)  # fmt: skip
                return result

        leaky = Leaky(episode.task, episode.tools, episode.turns)
        return leaky


class TrustsTools(EchoEnvironment):
    """Calls the tool function directly: an unknown tool or bad arguments raise."""

    def episode(self, task):
        class Trusting(EchoEpisode):
            def step(self, turn):
                if turn.tool_calls:
                    call = turn.tool_calls[0]
                    text = self.tools[call.name].function(**call.arguments)
                    return StepResult(({"role": "tool", "content": text},))
                return super().step(turn)

        return Trusting(task, self._tools, self.turns)


class TrustsArgumentTypes(EchoEnvironment):
    """Knows its tool but trusts the argument's type: ``{"text": 5}`` raises."""

    def episode(self, task):
        class Trusting(EchoEpisode):
            def step(self, turn):
                for call in turn.tool_calls:
                    if call.name == "echo" and "text" in call.arguments:
                        text = call.arguments["text"].strip()  # an int has no strip
                        return StepResult(({"role": "tool", "content": text},))
                return super().step(turn)

        return Trusting(task, self._tools, self.turns)


def echo_turns(task, said=None):
    """Echo the answer once, then say it (``said``: what the last turn says instead)."""
    from drivetrain.api.environment import ToolCall

    answer = str(task["answer"])
    call = ToolCall("echo", {"text": answer}, "c0")
    last = answer if said is None else said
    return [AssistantTurn(0, "", "", (call,)), AssistantTurn(1, last, last)]


class Demonstrates(EchoEnvironment):
    """Demonstrates its task: a harness without a solution uses the demonstration."""

    def demonstration(self, task):
        return echo_turns(task)


class DemonstratesNothing(EchoEnvironment):
    """Its demonstration of the fourth task onwards answers wrong: it earns nothing there (the
    harness's own solution, on the first four tasks, is right)."""

    def demonstration(self, task):
        wrong = str(int(task["answer"]) + 1)
        index = self.tasks("train", 8, 0).index(task)
        return echo_turns(task, said=wrong if index >= 4 else None)


class TextInfo(EchoEnvironment):
    def episode(self, task):
        class Texty(EchoEpisode):
            def step(self, turn):
                result = super().step(turn)
                return StepResult(result.observations, result.reward, result.done,
                                  {**result.info, "verdict": "ok"})  # fmt: skip

        return Texty(task, self._tools, self.turns)


PLANTED = [
    (LaxOptions, "options", r"options \{'no_such_option': 1\} were accepted"),
    (UnseededTasks, "tools_and_tasks", "differ from call to call: seed them"),
    (CountsAcrossEpisodes, "episodes_independent", "playing the same tasks again gave other"),
    (TrustsTools, "untrusted_turns", "step raised KeyError for a call of an unknown tool"),
    (
        TrustsArgumentTypes,
        "tool_arguments",
        r"step raised AttributeError for a call of echo with text=5 \(integer where the schema "
        r"says string\)",
    ),
    (TextInfo, "solution", r"info\['verdict'\] is 'ok', not a number"),
    (DemonstratesNothing, "solution", r"task 4: the environment's demonstration earned 0\.0"),
]


@pytest.mark.parametrize(("broken", "check", "message"), PLANTED)
def test_the_kit_names_a_broken_environment(broken, check, message):
    errors = {r.name: r.error for r in run_environment_conformance(EchoHarness(broken))}
    assert errors[check] is not None and re.search(message, errors[check]), errors


def test_bad_arguments_cover_types_values_and_sizes():
    from drivetrain.testing.tool_arguments import HUGE, bad_arguments

    schema = {
        "type": "object",
        "properties": {
            "letter": {"type": "string", "enum": ["a", "b"]},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["letter", "count"],
    }
    made = bad_arguments(schema)
    letters = [args["letter"] for why, args in made if why.startswith("letter=")]
    counts = [args["count"] for why, args in made if why.startswith("count=")]
    assert 5 in letters and None in letters and ["a"] in letters and HUGE in letters
    assert "not-one-of-them" in letters and "a" not in letters
    assert {0, 10, 10**18, -1, "five", None} <= {
        c for c in counts if not isinstance(c, list | dict)
    }
    # the other required argument is plausible while one is bad
    assert all(args["count"] == 1 for why, args in made if why.startswith("letter="))
    assert all(args["letter"] == "a" for why, args in made if why.startswith("count="))


class DemonstratedHarness(EnvironmentHarness):
    """No solution: the kit plays the environment's demonstration."""

    def __init__(self, environment_class=Demonstrates):
        self.environment_class = environment_class

    def make_environment(self, options=None):
        return self.environment_class(options)

    def bad_options(self):
        return [{"turns": 0}]


def test_the_solution_defaults_to_the_demonstration():
    results = run_environment_conformance(DemonstratedHarness())
    assert len(results) == 7 and not [r for r in results if r.error], results
    task = Demonstrates().tasks("train", 1, 0)[0]
    assert DemonstratedHarness().solution(task) == echo_turns(task)


def test_no_solution_and_no_demonstration_says_what_to_write():
    errors = {
        r.name: r.error for r in run_environment_conformance(DemonstratedHarness(EchoEnvironment))
    }
    assert "EchoEnvironment gives no demonstration of task" in errors["solution"], errors
    assert (
        "give the harness a solution(task), or the environment a demonstration(task)"
        in (errors["solution"])
    )
