"""``drivetrain plan`` (issue 58, items 1-2): the built-in jobs plan in seconds from an empty
cache; a job that cannot fit a stated GPU is refused in one line naming its largest
contributor and settings that fit, and the first of those settings' plan does fit."""

from __future__ import annotations

import json
import re

import pytest
from transformers import LlamaConfig
from typer.testing import CliRunner

from drivetrain.trainer.cli import app

runner = CliRunner()
pytestmark = pytest.mark.timeout(600)


def _plan(*args: str):
    return runner.invoke(app, ["plan", *args], env={"COLUMNS": "400"})


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DRIVETRAIN_CACHE", str(tmp_path / "cache"))


@pytest.mark.parametrize("job", ["grpo", "sft"])
def test_the_builtin_jobs_plan_from_an_empty_cache(empty_cache, job):
    done = _plan(job, "--gpus", "1", "--json")
    assert done.exit_code == 0, done.output
    # (the runner mixes stderr's progress bars into the output: the JSON is its last object)
    result = json.loads(done.output[done.output.rindex('{"job"') :])
    (role,) = result["roles"]
    assert result["fits"] and 0 < result["peak_gib"] < 2, result
    assert role["planned"] and role["gib"]["activations"] > role["gib"]["optimizer"] > 0
    assert result["step_time"]["roofline_s"] > 0
    flipped = result["checkpointing_flipped"]  # the other way round: what checkpointing saves
    assert flipped["gradient_checkpointing"]
    assert flipped["activations_gib"] < role["gib"]["activations"] / 2


def test_a_job_that_does_not_fit_names_what_would(empty_cache, tmp_path):
    model = tmp_path / "llama1b"
    LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True,
    ).save_pretrained(model)  # fmt: skip
    job = [
        "sft", f"engine.model.path={model}", f"data.train_path={tmp_path / 'none.jsonl'}",
        "engine.model.dtype=bfloat16", "data.max_length=4096", "run.batch_size=16",
        "engine.micro_batch.max_tokens=16384", "--gpus", "1", "--gpu", "a100-40gb",
    ]  # fmt: skip
    done = _plan(*job)
    assert done.exit_code == 1, done.output
    line = done.output.strip().splitlines()[-1]
    assert re.search(
        r"engine trains needs 4\d\.\d GiB a rank on 1 x a100-40gb \(39.4 GiB\)", line
    ), line
    assert "largest (GiB): activations" in line
    fix = re.search(
        r"fits with: (engine\.model\.gradient_checkpointing=true) \((\d+\.\d) GiB\)", line
    )
    assert fix and float(fix.group(2)) < 39.4, line
    again = _plan(*job, fix.group(1))  # the named setting's plan fits
    assert again.exit_code == 0 and ": fits" in again.output, again.output


def test_on_a_gpu_a_job_that_will_not_fit_is_refused_before_it_starts(
    empty_cache, tmp_path, monkeypatch
):
    """The check runs where there is device memory to check: a GPU (faked here, with 0.1 GiB)."""
    from drivetrain.trainer import device_defaults, planning
    from drivetrain.trainer.plan_target import Accelerator, PlanTarget
    from drivetrain.trainer.sft import job as sft_job

    small = Accelerator("tiny-gpu", 0.1, 0.0, 0.0)
    monkeypatch.setattr(device_defaults, "on_gpu", lambda: True)
    monkeypatch.setattr(planning, "local_target", lambda gpus: PlanTarget(small, gpus=gpus))

    def started(*args, **kwargs):
        raise RuntimeError("the run started")

    monkeypatch.setattr(sft_job, "run_sft", started)
    monkeypatch.setattr(sft_job, "numerics_line", lambda config, roles: "(no device to name)")
    out = f"run.output_dir={tmp_path / 'run'}"
    refused = runner.invoke(app, ["sft", out], env={"COLUMNS": "400"})
    assert refused.exit_code == 2, refused.output
    assert re.search(
        r"this job will not fit: engine trains needs \d\.\d GiB a rank on 1 x tiny-gpu",
        refused.output,
    )
    assert "--no-plan-check starts it anyway" in refused.output
    assert not (tmp_path / "run").exists()
    anyway = runner.invoke(app, ["sft", out, "--no-plan-check"], env={"COLUMNS": "400"})
    assert isinstance(anyway.exception, RuntimeError), anyway.output  # it went on to train


def test_ppo_plans_every_role_and_the_colocated_rollout_in_its_phases(empty_cache, tmp_path):
    """Actor and critic train, the reference scores, a vLLM rollout takes its
    gpu_memory_utilization while it generates; each phase holds the others' states."""
    model = tmp_path / "small"
    LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True,
    ).save_pretrained(model)  # fmt: skip
    done = _plan(
        "ppo", f"actor.model.path={model}", f"data.train_path={tmp_path / 'none.jsonl'}",
        "algorithm.kl.coef=0.01", "workers.num=8", "placement.mode=colocated",
        "rollout.gpu_memory_utilization=0.4", "--rollout", "vllm", "--gpus", "8", "--json",
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    result = json.loads(done.output[done.output.rindex('{"job"') :])
    roles = {r["role"]: r for r in result["roles"]}
    assert {name: r["trains"] for name, r in roles.items()} == {
        "actor": True, "reference": False, "critic": True,
    }  # fmt: skip
    phases = {p["phase"]: p for p in result["phases"]}
    assert set(phases) == {"rollout generates", "actor trains", "reference scores", "critic trains"}
    generate = phases["rollout generates"]["parts"]
    assert generate["rollout vllm"] == pytest.approx(0.4 * 79.6, abs=0.01)
    trains = phases["actor trains"]["parts"]
    assert trains["actor peak"] == pytest.approx(roles["actor"]["peak_gib"], abs=0.01)
    assert set(trains) == {"actor peak", "reference (held)", "critic (held)"}  # vLLM sleeps
    assert result["busiest"] == "rollout generates" and result["fits"]
