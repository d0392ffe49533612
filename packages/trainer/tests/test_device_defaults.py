"""The GPU defaults (issue 57, item 5): on a GPU a job that says nothing of dtypes trains and
samples in bfloat16, anything the user or a file says wins, ``--print-config`` shows the
result, and the start prints it; on the CPU nothing changes."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from drivetrain.api import EngineConfig
from drivetrain.trainer import device_defaults
from drivetrain.trainer.cli import app
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.sft.config import sft_config_type

runner = CliRunner()


@pytest.fixture
def gpu(monkeypatch):
    """This process sees a GPU (for the config only: nothing here runs on one)."""
    monkeypatch.setattr(device_defaults, "on_gpu", lambda: True)


def test_the_dtype_keys_are_every_engine_and_rollout_section():
    assert device_defaults.dtype_keys(RLConfig) == [
        "actor.model.dtype",
        "critic.model.dtype",
        "rollout.dtype",
    ]
    assert device_defaults.dtype_keys(sft_config_type(EngineConfig)) == ["engine.model.dtype"]


def test_on_the_cpu_there_is_no_layer(monkeypatch):
    monkeypatch.setattr(device_defaults, "on_gpu", lambda: False)
    assert device_defaults.device_layer(RLConfig) == ()
    assert device_defaults.device_layers(RLConfig) == []


def test_the_gpu_layer_is_beneath_what_the_user_says(gpu, tmp_path):
    layer = device_defaults.device_layer(RLConfig)
    assert layer == tuple(f"{k}=bfloat16" for k in device_defaults.dtype_keys(RLConfig))
    said = tmp_path / "mine.yaml"
    said.write_text("critic:\n  model:\n    dtype: float32\n")
    overrides = ["rollout.dtype=float16"]
    device = device_defaults.device_layers(RLConfig, [said], overrides)
    config = load_config(RLConfig, files=[*device, said], overrides=overrides)
    assert config.actor.model.dtype == "bfloat16"  # unset: the GPU's default
    assert config.critic.model.dtype == "float32"  # a file said so
    assert config.rollout.dtype == "float16"  # an override said so


def test_a_role_put_on_the_cpu_keeps_float32(gpu, tmp_path):
    said = tmp_path / "mine.yaml"
    said.write_text("rollout:\n  device: cpu\n")
    overrides = ["critic.device=cpu"]
    assert device_defaults.device_layer(RLConfig, [said], overrides) == (
        "actor.model.dtype=bfloat16",
    )


def test_the_builtin_sft_stays_the_shipped_job_on_a_gpu(gpu, tmp_path, monkeypatch):
    """The built-in SFT model is cached only by the run of the job as shipped: the device
    layer must be part of what counts as shipped, or every GRPO run would train it again."""
    from drivetrain.trainer.builtin.addition_sft import addition_sft
    from drivetrain.trainer.sft.job import load_sft_job

    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path / "cache"))
    job = load_sft_job("fake", task=addition_sft)
    assert job.config.engine.model.dtype == "bfloat16" and job.as_shipped
    said = load_sft_job("fake", overrides=["engine.model.dtype=float32"], task=addition_sft)
    assert said.config.engine.model.dtype == "float32" and not said.as_shipped


def _printed(*args: str) -> dict:
    result = runner.invoke(app, list(args), env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    text = result.output[result.output.index("actor:") :]
    return yaml.safe_load(text)


def test_print_config_shows_the_gpu_choice(gpu, tmp_path, monkeypatch):
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path / "cache"))
    config = _printed("grpo", "--engine", "fake", "--rollout", "fake", "--print-config")
    assert config["actor"]["model"]["dtype"] == "bfloat16"
    assert config["rollout"]["dtype"] == "bfloat16"
    kept = _printed(
        "grpo", "--engine", "fake", "--rollout", "fake", "--print-config",
        "actor.model.dtype=float32", "rollout.dtype=float32",
    )  # fmt: skip
    assert kept["actor"]["model"]["dtype"] == kept["rollout"]["dtype"] == "float32"
    sft = _printed_sft(tmp_path)
    assert sft["engine"]["model"]["dtype"] == "bfloat16"


def _printed_sft(tmp_path) -> dict:
    result = runner.invoke(app, ["sft", "--engine", "fake", "--print-config"])
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.output[result.output.index("engine:") :])


def test_print_config_on_the_cpu_keeps_float32(tmp_path, monkeypatch):
    monkeypatch.setattr(device_defaults, "on_gpu", lambda: False)
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path / "cache"))
    config = _printed("grpo", "--engine", "fake", "--rollout", "fake", "--print-config")
    assert config["actor"]["model"]["dtype"] == config["rollout"]["dtype"] == "float32"


def test_the_start_line_names_each_role_dtype(monkeypatch):
    monkeypatch.setattr(device_defaults, "on_gpu", lambda: False)
    config = load_config(RLConfig, overrides=["actor.model.dtype=bfloat16"])
    line = device_defaults.numerics_line(config, ["actor", "rollout", "reference"])
    # the critic is no role of this run
    assert line == "numerics on cpu: actor bfloat16 (float32 master weights), rollout float32"
