"""``drivetrain grpo env=verifiers``: the adapter (its own distribution) trains against a real
verifiers environment served by the hub's own server, in a virtual environment of its own
(verifiers from PyPI; never in the workspace). The environment is
``packages/env-verifiers/tests/hub_envs/drivetrain_echo.py``, written with verifiers' classes;
its ``length`` score (longer replies score more, up to 1) gives an untrained model's samples
rewards that differ, so the steps update the model. The hub's ``null`` harness plays one chat
turn an episode; the package's own tests play tool calls and several turns."""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import pytest

from drivetrain.envs.verifiers.venv import make_venv
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from rl_support import metrics_rows, run_rl

# slow: a verifiers venv (seconds from uv's cache), the hub's two processes importing verifiers
# and a two-step job: 60-85 s here, over the default set's 30 s budget
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ENVS = Path(__file__).parents[1] / "packages/env-verifiers/tests/hub_envs"


def test_grpo_trains_against_a_verifiers_environment(tmp_path):
    """A tiny chat model, two steps of 2 prompts x 2 samples, rewarded by the hub."""
    try:
        python = make_venv(tmp_path / "venv")
    except Exception as exc:  # the one reason to skip: PyPI unreachable (uv's cache may do)
        try:
            urllib.request.urlopen("https://pypi.org/simple/verifiers/", timeout=10).close()
        except OSError:
            pytest.skip(f"verifiers cannot be installed: PyPI is unreachable ({exc})")
        raise
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRIVETRAIN_CACHE": str(tmp_path / "cache")}
    summary, _ = run_rl(
        "grpo", "env=verifiers", "episode.options.id=drivetrain_echo",
        f"episode.options.python={python}", f"episode.options.pythonpath={ENVS}",
        "episode.options.config.agent.harness.id='null'",
        "episode.options.config.taskset.task.score=length", "episode.options.val.split=val",
        "data.val_size=1", f"actor.model.path={model}", f"run.output_dir={out}", "run.steps=2",
        "run.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=8",
        "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false",
        env=env, timeout=280,
    )  # fmt: skip
    assert summary["steps"] == 2
    config = (out / "config.yaml").read_text()
    assert "env: verifiers" in config and "id: drivetrain_echo" in config
    steps = [r for r in metrics_rows(out) if "reward/mean" in r]
    assert len(steps) == 2
    for step in steps:
        assert step["episode/turns_mean"] == 1.0  # the null harness: one chat turn
        assert 0.0 < step["reward/mean"] <= 1.0
        assert step["env/verifiers/reward/said_it"] == step["reward/mean"]
    # the hub's rewards differed within a group, so the policy moved
    assert any(s["advantages/abs_mean"] > 0 and s["actor/grad_norm"] > 0 for s in steps), steps
