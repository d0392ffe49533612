"""Config errors a user causes name the full dotted key, and GRPO refuses groups of one
(issue 59: one line for every failure a user can cause)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from drivetrain.api import ConfigError
from drivetrain.trainer.cli import app
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.dpo.job import load_dpo_job
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.job import load_rl_job
from drivetrain.trainer.sft.job import load_sft_job

pytestmark = pytest.mark.fault

RL = ["data.train_path=x.jsonl", "actor.model.path=m"]
SUPERVISED = ["data.train_path=x.jsonl", "engine.model.path=m"]


def _refusal(load, override: str) -> str:
    with pytest.raises(ConfigError) as err:
        load(override)
    return str(err.value)


def _rl(override: str) -> None:
    load_rl_job("grpo", engine="fsdp2", overrides=[*RL, override])


def _sft(override: str) -> None:
    load_sft_job("fsdp2", overrides=[*SUPERVISED, override])


def _dpo(override: str) -> None:
    load_dpo_job("fsdp2", overrides=[*SUPERVISED, override])


@pytest.mark.parametrize(
    ("load", "override", "starts"),
    [
        (_rl, "actor.optim.lr=-0.001", "actor.optim.lr=-0.001 must be > 0"),
        (_rl, "critic.optim.scheduler=step", "critic.optim.scheduler='step' is not one of"),
        (_rl, "actor.model.lora.dropout=2", "actor.model.lora.dropout=2.0 must be in [0, 1)"),
        (_rl, "actor.model.dtype=int8", "actor.model.dtype='int8' is not one of"),
        (_rl, "actor.strategy=ddp", "actor.strategy='ddp' is not one of"),  # the engine's own
        (_sft, "engine.optim.lr=-0.001", "engine.optim.lr=-0.001 must be > 0"),
        (_sft, "engine.ulysses_size=0", "engine: ulysses_size"),  # names no key: says where
        (_dpo, "engine.optim.eps=0", "engine.optim.eps=0.0 must be > 0"),
    ],
)
def test_a_nested_sections_error_names_the_full_key(load, override: str, starts: str) -> None:
    assert _refusal(load, override).startswith(starts)


def test_every_key_of_the_message_is_made_full() -> None:
    message = _refusal(_rl, "actor.micro_batch.micro_batch_size=2")
    assert message.startswith("actor.micro_batch: set exactly one of micro_batch_size")
    assert "actor.micro_batch.micro_batch_size=2, actor.micro_batch.max_tokens=8192" in message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # already full: not prefixed again (a top-level section, a nested one, the top level)
        ("run.steps=0", "run.steps=0 must be >= 1"),
        ("algorithm.clip.dual=0.5", "algorithm.clip.dual=0.5 must be > 1 (or 0: off)"),
        (
            "algorithm.correction.cap=-1",
            "algorithm.correction.cap must be > 0 and 0 <= algorithm.correction.low <= "
            "algorithm.correction.high",
        ),
        ("teacher.coef=0", "teacher.coef=0.0 must be > 0"),
    ],
)
def test_full_keys_are_not_prefixed_twice(override: str, message: str) -> None:
    assert _refusal(_rl, override) == message


def test_the_command_line_says_the_full_key() -> None:
    result = CliRunner().invoke(app, ["grpo", "actor.optim.lr=-0.001"], env={"COLUMNS": "250"})
    assert result.exit_code == 2, result.output
    assert "error: actor.optim.lr=-0.001 must be > 0" in result.output.splitlines()


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_a_group_relative_estimator_refuses_groups_of_one(advantage: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(RLConfig, overrides=["sampling.n=1", f"algorithm.advantage={advantage}"])
    message = str(err.value)
    assert message.startswith(
        f"sampling.n=1: algorithm.advantage={advantage} needs groups of at least 2 samples"
    )
    assert "sampling.n>=2" in message
    assert "algorithm.advantage=gae" in message and "algorithm.advantage=reinforce_pp " in message


@pytest.mark.parametrize("advantage", ["gae", "reinforce_pp", "distill"])
def test_estimators_with_their_own_baseline_take_one_sample(advantage: str) -> None:
    config = load_config(RLConfig, overrides=["sampling.n=1", f"algorithm.advantage={advantage}"])
    assert config.sampling.n == 1


def test_ppo_keeps_one_sample_and_grpo_its_groups() -> None:
    assert load_rl_job("ppo", engine="fsdp2", overrides=RL).config.sampling.n == 1
    assert load_rl_job("grpo", engine="fsdp2", overrides=[*RL, "sampling.n=2"])
    with pytest.raises(ConfigError, match=r"^sampling.n=1: algorithm.advantage=grpo needs"):
        _rl("sampling.n=1")
