"""One function owns a row's ground truth, on the plain prompt path and the agent path alike;
an agent's rows without one, while the reward functions check one, are refused at start
(issue 59: the agent path scored chat-message rows 0.000 every step, silently)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from drivetrain.trainer.cli import app
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.preflight import Context
from drivetrain.trainer.rl import job as rl_job
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.episode_setup import episode_setup
from drivetrain.trainer.rl.prompts import row_ground_truth, rows_to_prompts
from drivetrain.trainer.rl.scoring import SampleScorer
from trainer_fixtures import write_jsonl

CHAT = {"messages": [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "42"}]}
UNANSWERED = {"messages": [{"role": "user", "content": "6*7?"}]}
CONTEXT = Context(256, "the test model's context")


@pytest.mark.parametrize(
    ("row", "truth"),
    [
        ({"prompt": "6*7?", "answer": "42"}, "42"),
        ({"prompt": "6*7?", "answer": 42}, "42"),
        ({"prompt": "1-1?", "answer": 0}, "0"),  # falsy, still an answer
        (CHAT, "42"),  # the final assistant message
        ({**CHAT, "answer": "41"}, "41"),  # answer_key wins
        (UNANSWERED, None),
        ({"prompt": "6*7?"}, None),
        ({"messages": [{"role": "assistant", "content": None}]}, None),
    ],
)
def test_the_ground_truth_of_a_row(row: dict, truth: str | None) -> None:
    assert row_ground_truth(row, "answer", "messages") == truth


def test_the_agent_path_scores_chat_rows_as_the_plain_path_does(tokenizer) -> None:
    """The same row: the plain path's prompt carries 42 as its ground truth, and an agent's
    episode answering 42 scores 1 (it scored 0, the row having no 'answer')."""
    prompts, _ = rows_to_prompts(
        [("t.jsonl:1", CHAT)], tokenizer, prompt_key="prompt", messages_key="messages",
        answer_key="answer", max_prompt_length=64, max_new_tokens=8, context=CONTEXT,
    )  # fmt: skip
    assert prompts[0].ground_truth == "42" and "42" not in prompts[0].text
    scorer = SampleScorer(load_config(RLConfig), tokenizer)
    assert scorer.agent_reward(CHAT, "42") == 1.0
    assert scorer.agent_reward(CHAT, "41") == 0.0
    assert scorer.agent_reward(UNANSWERED, "42") == 0.0  # an environment's task: no truth


def _agent_config(data, *overrides: str) -> RLConfig:
    return load_config(
        RLConfig,
        overrides=["agent.command=true", f"data.train_path={data}", "run.prompts_per_step=1",
                   *overrides],
    )  # fmt: skip


@pytest.mark.fault
def test_an_agent_row_without_ground_truth_is_refused_at_start(tmp_path, tokenizer) -> None:
    data = write_jsonl(tmp_path / "tasks.jsonl", [CHAT, UNANSWERED, CHAT])
    with pytest.raises(DataError) as err:
        episode_setup(_agent_config(data), tokenizer, CONTEXT)
    message = str(err.value)
    assert message.startswith(f"{data}:2: no ground truth: neither 'answer' (data.answer_key)")
    assert "final assistant message in 'messages'" in message
    assert "reward.functions=['exact_match']" in message and "\n" not in message


@pytest.mark.parametrize(
    "overrides",
    [
        ["reward.weights=[0.0]"],  # the agent reports its rewards: the functions weigh nothing
        ["reward.functions=[format]"],  # reads no ground truth
    ],
)
def test_rows_without_ground_truth_are_fine_when_no_reward_checks_one(
    tmp_path, tokenizer, overrides: list[str]
) -> None:
    data = write_jsonl(tmp_path / "tasks.jsonl", [UNANSWERED, CHAT])
    setup = episode_setup(_agent_config(data, *overrides), tokenizer, CONTEXT)
    assert setup.train == [UNANSWERED, CHAT]


@pytest.mark.fault
def test_the_command_refuses_it_in_one_line_before_any_worker(
    tmp_path, tiny_model, monkeypatch
) -> None:
    def started(*args, **kwargs):
        raise AssertionError("workers started before the rows were refused")

    monkeypatch.setattr(rl_job, "start", started)
    data = write_jsonl(tmp_path / "tasks.jsonl", [CHAT, CHAT, UNANSWERED])
    args = [
        "grpo", "--engine", "fake", "--rollout", "fake", f"actor.model.path={tiny_model}",
        f"data.train_path={data}", f"run.output_dir={tmp_path / 'out'}", "agent.command=true",
        "run.prompts_per_step=2", "sampling.n=2",
    ]  # fmt: skip
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exit_code == 2, (result.output, result.exception)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert errors[0].startswith(f"error: {data}:3: no ground truth"), errors[0]
