"""``drivetrain grpo env=reasoning_gym``: the plugin (its own distribution) found by name and
trained on one of reasoning-gym's datasets, scored by that dataset's scorer."""

from __future__ import annotations

import os

import pytest

from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from rl_support import metrics_rows, run_rl

pytestmark = pytest.mark.timeout(300)


def test_grpo_trains_on_a_reasoning_gym_dataset(tmp_path):
    """A tiny chat model, one step of 2 prompts x 2 samples on ``chain_sum`` with two attempts
    an episode (the second after the dataset's verdict on the first); no system prompt, which
    the model's 256-token context has no room for. The run also proves ``run.max_seconds`` (a
    time budget, what ``benchmarks/real_task.py`` races on): 50 steps asked, a budget spent by
    the first, one step taken, then saved and validated as at its end (no run of its own)."""
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRIVETRAIN_CACHE": str(tmp_path / "cache")}
    summary, done = run_rl(
        "grpo", "env=reasoning_gym", "episode.options.dataset=chain_sum",
        "episode.options.max_terms=3", "episode.options.attempts=2",
        "episode.options.system_prompt=''", f"actor.model.path={model}", f"run.output_dir={out}",
        "run.steps=50", "run.max_seconds=0.001", "run.prompts_per_step=2", "sampling.n=2",
        "sampling.max_new_tokens=8",
        "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false",
        env=env, timeout=280,
    )  # fmt: skip
    # the time budget ran out in the first step: the run ended there, saved and validated
    assert summary["steps"] == 1 and "run.max_seconds=0.001 spent: 1 steps" in done.stderr
    assert (out / "checkpoints" / "step_00000001").is_dir() and "val_after" in summary
    config = (out / "config.yaml").read_text()
    assert "env: reasoning_gym" in config and "dataset: chain_sum" in config
    step = next(r for r in metrics_rows(out) if "reward/mean" in r)
    assert "env/reasoning_gym/answered" in step, sorted(step)
    # an untrained model does not solve chain_sum: each episode took its second attempt
    assert step["episode/turns_mean"] == 2.0, {
        k: v for k, v in step.items() if "episode/trunc" in k or "done" in k or "env/" in k
    }
