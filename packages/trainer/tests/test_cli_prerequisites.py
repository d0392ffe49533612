"""``--print-config`` and ``--dry-run`` never train: with the built-in SFT model missing they
say that the run trains it first (on the chosen engine) instead of training it, and the
chained SFT of a real run uses ``--engine``, not fsdp2. ``drivetrain sft --print-config``
prints the keys every engine shares when the engine is not installed."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from drivetrain.api import registry
from drivetrain.api.errors import DrivetrainError
from drivetrain.trainer.cli import app
from drivetrain.trainer.sft import job as sft_job

runner = CliRunner()
PLUGINS = ["--engine", "fake"]
ROLLOUT = ["--rollout", "hf"]


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """An empty DRIVETRAIN_CACHE, and SFT that fails the test if anything starts it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(cache))

    def trained(*args, **kwargs):
        raise AssertionError("a command that only shows or checks trained a model")

    monkeypatch.setattr(sft_job, "run_sft", trained)
    return cache


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "250"})


@pytest.mark.parametrize(
    "args",
    [
        ["grpo", *PLUGINS, *ROLLOUT],
        ["ppo", *PLUGINS, "--critic-engine", "fsdp2", *ROLLOUT],  # the critic: value_head
        ["distill", *PLUGINS, *ROLLOUT],
        ["dpo", *PLUGINS],
    ],
    ids=["grpo", "ppo", "distill", "dpo"],
)
@pytest.mark.parametrize("mode", ["--print-config", "--dry-run"])
def test_show_and_check_describe_the_missing_sft_model(empty_cache, args, mode):
    result = invoke(*args, mode)
    assert result.exit_code == 0, result.output
    sft_model = empty_cache / "addition-v3" / "sft-model"
    assert f"the built-in SFT model {sft_model} does not exist yet" in result.output
    assert "`drivetrain sft --engine fake`" in result.output
    if args[0] == "distill":
        assert "the distillation student does not exist yet" in result.output
        assert "SFT steps on --engine fake" in result.output
    if mode == "--print-config":
        assert f"path: {sft_model}" in result.output  # the config names where it will be
    else:
        assert "dry run: config and" in result.output and "(no model checked)" in result.output
    if args[0] != "dpo":  # grpo's paths are named, not built (dpo derives its pairs from them)
        assert not empty_cache.exists()


@pytest.mark.parametrize(
    ("rollout", "line"), [("hf", "max_batch_size: 256"), ("fake", "vocab_size: 16")]
)
def test_the_builtin_job_takes_any_rollout(empty_cache, rollout, line):
    """The built-in job's hf-only settings come from their own file, merged for hf only."""
    result = invoke("grpo", *PLUGINS, "--rollout", rollout, "--print-config")
    assert result.exit_code == 0, result.output
    assert line in result.output and "max_model_len: 128" in result.output
    assert ("max_batch_size" in result.output) == (rollout == "hf")


def test_the_chained_sft_runs_on_the_chosen_engine(empty_cache, monkeypatch):
    chosen = []

    def load_sft_job(engine_name, **kwargs):
        chosen.append(engine_name)
        raise DrivetrainError("stop before training")

    monkeypatch.setattr(sft_job, "load_sft_job", load_sft_job)
    result = invoke("grpo", *PLUGINS, *ROLLOUT)
    assert result.exit_code == 2 and "stop before training" in result.output, result.output
    assert "running the SFT default first (`drivetrain sft --engine fake`)" in result.output
    assert chosen == ["fake"]


def test_sft_print_config_without_the_engine_shows_the_shared_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path))  # it builds the assets: not in ~
    monkeypatch.setenv(registry.ENV_VAR, "-fsdp2")  # as if drivetrain-engine-fsdp were missing
    registry.refresh_all()
    try:
        result = invoke("sft", "--print-config")
        assert result.exit_code == 0, result.output
        assert "note: engine 'fsdp2' (drivetrain-engine-fsdp" in result.output
        assert "showing the keys every engine shares" in result.output
        assert "optim:" in result.output and "micro_batch:" in result.output
        given = invoke("sft", "--print-config", *PLUGINS, "engine.vocab_size=99")
        assert given.exit_code == 0 and "vocab_size: 99" in given.output, given.output
        assert "note:" not in given.output
        refused = invoke("sft", "--dry-run")  # only showing the config falls back
        assert refused.exit_code == 2 and "error: engine 'fsdp2'" in refused.output
    finally:
        monkeypatch.undo()
        registry.refresh_all()
