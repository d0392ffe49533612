"""``drivetrain grpo env=openenv``: the adapter (its own distribution) trains against a real
OpenEnv server the test starts (OpenEnv's own ``create_app`` under uvicorn, in a process of its
own: ``packages/env-openenv/tests/openenv_servers.py``), multi-turn, rewarded by the server.
The guessing game is played turn by turn in the package's own tests; here the echo environment
(``openenv init``'s rule: longer messages score more, up to 1) gives an untrained model's
samples rewards that differ, so the steps update the model."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from rl_support import metrics_rows, run_rl

pytestmark = pytest.mark.timeout(300)

SERVER = Path(__file__).parents[1] / "packages/env-openenv/tests/openenv_servers.py"


def load_server():
    spec = importlib.util.spec_from_file_location("openenv_servers", SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_trains_against_an_openenv_server(tmp_path):
    """A tiny chat model, two steps of 2 prompts x 2 samples, two turns an episode (the echo
    never ends one: the trainer cuts it at ``episode.max_turns``)."""
    model = build_tiny_chat_model(tmp_path / "model")
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DRIVETRAIN_CACHE": str(tmp_path / "cache")}
    with load_server().serve("echo", max_sessions=8) as url:
        summary, _ = run_rl(
            "grpo", "env=openenv", f"episode.options.url={url}",
            "episode.options.system_prompt=Talk.", "episode.max_turns=2", "data.val_size=1",
            f"actor.model.path={model}", f"run.output_dir={out}", "run.steps=2",
            "run.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=4",
            "logging.progress=false", "logging.tensorboard=false", "run.export_hf=false",
            env=env, timeout=280,
        )  # fmt: skip
    assert summary["steps"] == 2
    config = (out / "config.yaml").read_text()
    assert "env: openenv" in config and "system_prompt: Talk." in config
    steps = [r for r in metrics_rows(out) if "reward/mean" in r]
    assert len(steps) == 2
    for step in steps:
        assert step["episode/turns_mean"] == 2.0 and step["episode/truncated/max_turns"] == 1.0
        assert 0.0 < step["reward/mean"] <= 2.0  # two turns of up to 1 each
    # the server's rewards differed within a group, so the policy moved
    assert any(s["advantages/abs_mean"] > 0 and s["actor/grad_norm"] > 0 for s in steps), steps
