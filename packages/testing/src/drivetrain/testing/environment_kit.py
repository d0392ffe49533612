"""The environment conformance kit: checks any :class:`~drivetrain.api.environment.Environment`
against the contract the trainer relies on.

An environment author writes an :class:`EnvironmentHarness` (how to make the environment, and
the assistant turns of one episode that earns a reward: by default the environment's own
:meth:`~drivetrain.api.environment.Environment.demonstration`, so the expert is written once)
and runs :func:`run_environment_conformance`, or inherits :class:`EnvironmentConformance`
under pytest.
The kit plays episodes itself, as the trainer does (``reset``, then ``step`` per assistant
turn, ``truncated`` when it cuts one short), with the harness's turns and with turns no policy
should write. Standard library only.
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from drivetrain.api.environment import (
    TRUNCATION_REASONS,
    AssistantTurn,
    Environment,
    Episode,
    StepResult,
    Task,
    ToolCall,
)
from drivetrain.testing.kit_runner import KitCheckResult, KitConformance, run_checks
from drivetrain.testing.tool_arguments import bad_arguments

ROLES = {"system", "user", "assistant", "tool"}


class EnvironmentHarness(abc.ABC):
    """What the kit needs to know about an environment."""

    @abc.abstractmethod
    def make_environment(self, options: Mapping[str, Any] | None = None) -> Environment:
        """The environment with these ``episode.options`` (``None``: its defaults)."""

    def solution(self, task: Task) -> list[AssistantTurn]:
        """The assistant turns of an episode of ``task`` that ends (``done``) at its last turn
        with a positive reward, as the trainer would pass them (tool calls parsed). Default:
        the environment's demonstration of ``task``; override it when there is none."""
        env = self.make_environment()
        turns = env.demonstration(task)
        if turns is None:
            raise AssertionError(
                f"{type(env).__name__} gives no demonstration of task {dict(task)!r:.100}: "
                "give the harness a solution(task), or the environment a demonstration(task)"
            )
        return list(turns)

    def tasks(self, environment: Environment) -> list[Task]:
        """At least 4 tasks; the default asks the environment for 8 (``tasks("train", 8,
        0)``). Environments that take a dataset return rows of it here."""
        return environment.tasks("train", 8, 0)

    def bad_options(self) -> list[dict[str, Any]]:
        """Options the environment must refuse with a one-line ``ValueError`` (beyond an
        unknown key, which the kit always tries)."""
        return []


def _turn(
    text: str, *, calls: Sequence[ToolCall] = (), errors: Sequence[str] = ()
) -> AssistantTurn:
    return AssistantTurn(0, text, text, tuple(calls), tuple(errors))


def _json(value: object, what: str) -> None:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise AssertionError(f"{what} is not plain JSON ({exc}): {value!r:.200}") from exc


def _assert_messages(messages: object, what: str) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise AssertionError(f"{what}: {type(messages).__name__}, wanted a list of messages")
    for m in messages:
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise AssertionError(
                f"{what}: {m!r:.200} is not a chat message (role one of {sorted(ROLES)})"
            )
        if not isinstance(m.get("content"), str):
            raise AssertionError(
                f"{what}: a {m['role']} message's content is "
                f"{type(m.get('content')).__name__}, not text"
            )
    _json(list(messages), what)


def _assert_result(result: object, what: str) -> StepResult:
    if not isinstance(result, StepResult):
        raise AssertionError(f"{what} returned {type(result).__name__}, not a StepResult")
    if not math.isfinite(result.reward):
        raise AssertionError(f"{what}: reward {result.reward}")
    _assert_messages(result.observations, f"{what}: observations")
    for key, value in result.info.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise AssertionError(
                f"{what}: info[{key!r}] is {value!r}, not a number (info "
                "values are summed over turns and averaged)"
            )
        if not math.isfinite(value):
            raise AssertionError(f"{what}: info[{key!r}] is {value}")
    return result


def _play(episode: Episode, turns: Sequence[AssistantTurn], what: str) -> list[StepResult]:
    """Reset, then step each turn until ``done``: the results, checked."""
    _assert_messages(episode.reset(), f"{what}: reset")
    results = []
    for turn in turns:
        result = _assert_result(episode.step(turn), f"{what}: step {turn.index}")
        results.append(result)
        if result.done:
            break
    return results


def _tasks(h: EnvironmentHarness, env: Environment) -> list[Task]:
    tasks = h.tasks(env)
    if len(tasks) < 4:
        raise AssertionError(f"the harness gave {len(tasks)} tasks, the kit needs 4")
    return tasks


# ---- the checks ----------------------------------------------------------------------------
def check_options(h: EnvironmentHarness) -> None:
    """The defaults build; an unknown option and each of the harness's bad options raise a
    one-line ``ValueError`` naming the option, before any episode."""
    h.make_environment(None)
    cases = [{"no_such_option": 1}, *h.bad_options()]
    for options in cases:
        try:
            h.make_environment(options)
        except ValueError as exc:
            line = str(exc)
            if "\n" in line.strip() or not any(key in line for key in options):
                raise AssertionError(
                    f"options {options}: the error {line!r} is not one line naming the option"
                ) from exc
        else:
            raise AssertionError(f"options {options} were accepted")


def check_tools_and_tasks(h: EnvironmentHarness) -> None:
    """Tools are OpenAI function schemas with distinct names, in plain JSON; tasks are plain
    JSON, and an environment that makes its own gives the same ones for the same split and
    seed and others for another seed or split."""
    env = h.make_environment()
    tools = list(env.tools())
    _json(tools, "tools()")
    names = []
    for schema in tools:
        function = schema.get("function") if isinstance(schema, Mapping) else None
        if schema.get("type") != "function" or not isinstance(function, Mapping):
            raise AssertionError(f"tool schema {schema!r:.200} is not OpenAI's function format")
        if not function.get("name") or function.get("parameters", {}).get("type") != "object":
            raise AssertionError(
                f"tool {function.get('name')!r}: needs a name and object parameters"
            )
        names.append(function["name"])
    if len(set(names)) != len(names):
        raise AssertionError(f"tool names repeat: {names}")
    _json(_tasks(h, env), "tasks")
    try:
        first = env.tasks("train", 6, 0)
    except NotImplementedError:
        return  # the job's dataset gives the tasks
    if first != env.tasks("train", 6, 0) or first != h.make_environment().tasks("train", 6, 0):
        raise AssertionError("tasks('train', 6, 0) differ from call to call: seed them")
    if first == env.tasks("train", 6, 1):
        raise AssertionError("tasks of seeds 0 and 1 are the same")
    if first == env.tasks("val", 6, 0):
        raise AssertionError("the train and val splits give the same tasks")


def _assert_earns(env: Environment, task: Task, turns: object, what: str) -> None:
    """``turns`` play ``task`` to ``done`` at the last one with a positive reward."""
    if not isinstance(turns, Sequence) or not all(isinstance(t, AssistantTurn) for t in turns):
        raise AssertionError(f"{what}: {turns!r:.200} is not a list of AssistantTurn")
    if not turns:
        raise AssertionError(f"{what}: no turns")
    results = _play(env.episode(task), turns, what)
    if not results[-1].done or len(results) != len(turns):
        raise AssertionError(
            f"{what}: its {len(turns)} turns ended the episode after {len(results)} "
            f"(done: {results[-1].done})"
        )
    earned = sum(r.reward for r in results)
    if not earned > 0:
        raise AssertionError(f"{what} earned {earned}")


def check_solution(h: EnvironmentHarness) -> None:
    """The harness's turns play each task to ``done`` at the last turn with a positive
    reward; every result is a StepResult with finite reward, chat-message observations and
    numeric info; two episodes of one task start alike. An environment's demonstration, when
    it gives one, earns a reward on every task of the harness (the built-in warm start trains
    on them)."""
    env = h.make_environment()
    tasks = _tasks(h, env)
    for i, task in enumerate(tasks[:4]):
        if env.episode(task).reset() != env.episode(task).reset():
            raise AssertionError(f"task {i}: two episodes of it start with other messages")
        _assert_earns(env, task, h.solution(task), f"task {i}: the solution")
    for i, task in enumerate(tasks):
        turns = env.demonstration(task)
        if turns is not None:
            _assert_earns(env, task, turns, f"task {i}: the environment's demonstration")


def _untrusted_turns(env: Environment) -> dict[str, AssistantTurn]:
    """Turns no policy should write, which an episode must turn into observations."""
    turns = {
        "an empty turn": _turn(""),
        "a 100,000-character turn": _turn("9" * 100_000),
        "an unparsable tool call": _turn("<tool_call>{oops", errors=("malformed JSON",)),
        "a call of an unknown tool": _turn("", calls=[ToolCall("no_such_tool", {}, "c1")]),
    }
    for schema in env.tools():
        name = schema["function"]["name"]
        turns[f"a call of {name} without arguments"] = _turn("", calls=[ToolCall(name, {}, "c2")])
        turns[f"a call of {name} with nonsense"] = _turn(
            "", calls=[ToolCall(name, {"no_such_argument": [1, {"x": None}]}, "c3")]
        )
    return turns


def check_untrusted_turns(h: EnvironmentHarness) -> None:
    """``step`` never raises for what the policy wrote: empty or huge turns, unparsable
    calls, unknown tools, missing or nonsense arguments each give a StepResult; a bad call
    to an environment with tools is answered (an observation) and counted in
    ``tools/calls``."""
    env = h.make_environment()
    task = _tasks(h, env)[0]
    has_tools = bool(list(env.tools()))
    for what, turn in _untrusted_turns(env).items():
        episode = env.episode(task)
        episode.reset()
        try:
            stepped = episode.step(turn)
        except Exception as exc:
            raise AssertionError(f"step raised {type(exc).__name__} for {what}: {exc}") from exc
        result = _assert_result(stepped, what)
        calls = bool(turn.tool_calls or turn.call_errors)
        if has_tools and calls and not result.done and not result.observations:
            raise AssertionError(f"{what} got no observation")
        if has_tools and calls and not result.info.get("tools/calls"):
            raise AssertionError(f"{what}: info has no tools/calls (run_tool_calls counts it)")


def check_tool_arguments(h: EnvironmentHarness) -> None:
    """``step`` never raises for a tool call's argument values: each argument of each tool,
    in turn, of every other JSON type, ``None``, a list, a huge string, out of its enum or
    range (:func:`~drivetrain.testing.tool_arguments.bad_arguments`) gives a StepResult. A
    policy early in training writes all of them; ``run_tool_calls`` answers the types, the
    tool itself must answer the values."""
    env = h.make_environment()
    task = _tasks(h, env)[0]
    for schema in env.tools():
        function = schema["function"]
        name = function["name"]
        for k, (what, arguments) in enumerate(bad_arguments(function.get("parameters") or {})):
            episode = env.episode(task)
            episode.reset()
            turn = _turn("", calls=[ToolCall(name, arguments, f"f{k}")])
            try:
                stepped = episode.step(turn)
            except Exception as exc:
                raise AssertionError(
                    f"step raised {type(exc).__name__} for a call of {name} with {what}: "
                    f"{str(exc)[:200]}"
                ) from exc
            _assert_result(stepped, f"a call of {name} with {what}")


def check_episodes_independent(h: EnvironmentHarness) -> None:
    """Episodes share no state: each task played alone, twice, interleaved turn by turn with
    another task and in threads (the trainer steps episodes of one environment at once)
    gives the same results."""
    env = h.make_environment()
    tasks = _tasks(h, env)[:4]
    solutions = [h.solution(t) for t in tasks]

    def alone(i: int) -> list[StepResult]:
        return _play(env.episode(tasks[i]), solutions[i], f"task {i}")

    reference = [alone(i) for i in range(len(tasks))]
    if [alone(i) for i in range(len(tasks))] != reference:
        raise AssertionError("playing the same tasks again gave other results")
    episodes = [env.episode(t) for t in tasks]
    for e in episodes:
        e.reset()
    interleaved: list[list[StepResult]] = [[] for _ in tasks]
    for step in range(max(len(s) for s in solutions)):
        for i, e in enumerate(episodes):
            if step < len(solutions[i]) and not (interleaved[i] and interleaved[i][-1].done):
                interleaved[i].append(e.step(solutions[i][step]))
    if interleaved != reference:
        i = next(i for i, (a, b) in enumerate(zip(interleaved, reference, strict=True)) if a != b)
        raise AssertionError(
            f"task {i} gave other results when its turns alternated with "
            "other episodes': episodes share state"
        )
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(alone, [i for i in range(len(tasks)) for _ in range(4)]))
    if threaded != [r for r in reference for _ in range(4)]:
        raise AssertionError(
            "episodes stepped in threads gave other results: shared state needs a lock, or none"
        )


def check_truncation(h: EnvironmentHarness) -> None:
    """An episode cut short (after the solution's first turn, when that does not end it), for
    each of the trainer's reasons, gives a finite last reward without raising."""
    env = h.make_environment()
    task = _tasks(h, env)[0]
    first = h.solution(task)[:-1][:1]  # a turn that does not end it, if it has one
    for reason in TRUNCATION_REASONS:
        episode = env.episode(task)
        _play(episode, first, f"truncated ({reason})")
        try:
            reward = episode.truncated(reason)
        except Exception as exc:
            raise AssertionError(
                f"truncated({reason!r}) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise AssertionError(f"truncated({reason!r}) returned {reward!r}")


ENVIRONMENT_CHECKS: dict[str, Callable[[EnvironmentHarness], None]] = {
    "options": check_options,
    "tools_and_tasks": check_tools_and_tasks,
    "solution": check_solution,
    "untrusted_turns": check_untrusted_turns,
    "tool_arguments": check_tool_arguments,
    "episodes_independent": check_episodes_independent,
    "truncation": check_truncation,
}


EnvironmentCheckResult = KitCheckResult


def run_environment_conformance(h: EnvironmentHarness) -> list[KitCheckResult]:
    """Every check; failures are collected, not raised."""
    return run_checks(ENVIRONMENT_CHECKS, h)


class EnvironmentConformance(KitConformance):
    """Inherit under pytest and implement :meth:`harness`; each check becomes a test."""

    CHECKS = ENVIRONMENT_CHECKS
