"""reasoning-gym's tasks as episodes: reproducible splits, the dataset's own scorer as the
reward, a retry for a wrong answer, and one-line errors for bad options."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from drivetrain.api.environment import AssistantTurn
from drivetrain.api.registry import environments
from drivetrain.envs.reasoning_gym.environment import ReasoningGymEnvironment


def answer(text: str, index: int = 0) -> AssistantTurn:
    return AssistantTurn(index, text, text)


def test_tasks_are_reproducible_and_the_splits_differ():
    env = ReasoningGymEnvironment({"dataset": "chain_sum", "max_terms": 3})
    train = env.tasks("train", 16, seed=1)
    assert train == ReasoningGymEnvironment({"dataset": "chain_sum", "max_terms": 3}).tasks(
        "train", 16, seed=1
    )
    assert train != env.tasks("train", 16, seed=2)
    held_out = {t["question"] for t in env.tasks("val", 16, seed=1)}
    assert len(held_out & {t["question"] for t in train}) <= 1  # a chance collision at most
    assert all(t["metadata"]["num_terms"] <= 3 for t in train)  # the dataset's own option


def test_the_datasets_scorer_is_the_reward():
    env = environments.load("reasoning_gym")({"dataset": "chain_sum"})
    task = env.tasks("train", 1, seed=0)[0]
    episode = env.episode(task)
    messages = episode.reset()
    assert messages[0]["role"] == "system" and "<answer>" in messages[0]["content"]
    assert messages[-1] == {"role": "user", "content": task["question"]}
    right = episode.step(answer(f"Adding up: <answer>{task['answer']}</answer>"))
    assert right.done and right.reward == 1.0
    wrong = env.episode(task).step(answer(f"<answer>{int(task['answer']) + 1}</answer>"))
    assert wrong.done and wrong.reward == 0.0
    untagged = env.episode(task).step(answer(str(task["answer"])))
    assert untagged.done and untagged.reward == 0.0 and untagged.info["reasoning_gym/answered"] == 0


def test_a_wrong_answer_is_told_so_while_attempts_remain():
    env = ReasoningGymEnvironment({"dataset": "chain_sum", "attempts": 2, "system_prompt": ""})
    task = env.tasks("val", 1, seed=0)[0]
    episode = env.episode(task)
    assert [m["role"] for m in episode.reset()] == ["user"]
    first = episode.step(answer("<answer>nonsense</answer>"))
    assert (
        not first.done and first.reward == 0.0 and "not correct" in first.observations[0]["content"]
    )
    second = episode.step(answer(f"<answer>{task['answer']}</answer>", 1))
    assert second.done and second.reward == 1.0


def test_an_instruction_and_plain_answers_for_models_too_small_for_tags():
    env = ReasoningGymEnvironment(
        {"dataset": "chain_sum", "system_prompt": "", "instruction": "Reply with the number only.",
         "answer_format": "last_number", "attempts": 2}
    )  # fmt: skip
    task = env.tasks("train", 1, seed=0)[0]
    episode = env.episode(task)
    assert episode.reset() == [
        {"role": "user", "content": f"{task['question']} Reply with the number only."}
    ]
    missed = episode.step(answer("I do not know."))
    assert not missed.done and missed.info["reasoning_gym/answered"] == 0.0
    assert missed.observations[0]["content"] == "No answer found: give only the final number."
    right = episode.step(answer(f"12 + 3 is not it; the sum is {task['answer']}.", 1))
    assert right.done and right.reward == 1.0  # the reply's last number, the dataset's scorer
    whole = ReasoningGymEnvironment({"dataset": "chain_sum", "answer_format": "reply"})
    assert whole.episode(task).step(answer(f" {task['answer']}\n")).reward == 1.0


@pytest.mark.parametrize(
    "options, message",
    [
        ({}, "set episode.options.dataset to one of its"),
        ({"dataset": "chian_sum"}, "no dataset 'chian_sum'; did you mean chain_sum"),
        ({"dataset": "chain_sum", "max_term": 3}, "has no option max_term; it takes"),
        ({"dataset": "chain_sum", "seed": 3}, "has no option seed"),
        ({"dataset": "chain_sum", "min_terms": 0}, "rejects options {'min_terms': 0}"),
        ({"dataset": "chain_sum", "system_prompt": "loud"}, "system_prompt 'loud' is none of"),
        ({"dataset": "chain_sum", "attempts": 0}, "attempts must be >= 1"),
        ({"dataset": "chain_sum", "answer_format": "xml"}, "answer_format is one of tags, "),
    ],
)
def test_bad_options_fail_in_one_line(options, message):
    with pytest.raises(ValueError) as failure:
        ReasoningGymEnvironment(options)
    assert message in str(failure.value) and "\n" not in str(failure.value)


LISTING = """
import sys
from drivetrain.trainer.cli import app
try:
    app(["environments"])
except SystemExit as exit:
    assert not exit.code, exit.code
print("IMPORTED" if "reasoning_gym" in sys.modules else "NOT IMPORTED")
"""


def test_drivetrain_environments_lists_it_without_importing_reasoning_gym():
    wide = {**os.environ, "COLUMNS": "200"}  # one line a row
    out = subprocess.run(
        [sys.executable, "-c", LISTING],
        capture_output=True, text=True, check=True, timeout=120, env=wide,
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("│ reasoning_gym ")]
    assert rows and "drivetrain-env-reasoning-gym 0.1.0" in rows[0], out
    assert out.strip().endswith("NOT IMPORTED")
