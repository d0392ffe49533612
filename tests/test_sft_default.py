"""The README's main job: `drivetrain sft` with no arguments trains the built-in model on the
addition task, and its exact-match accuracy rises well above the untrained model's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from drivetrain.trainer.builtin.addition import cached_sft_model
from sft_support import sft_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_default_sft_job(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "drivetrain.trainer", "sft", f"run.output_dir={out}"]
    done = subprocess.run(cmd, env=sft_env(tmp_path), capture_output=True, text=True, timeout=850)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 600
    assert summary["accuracy_before"] < 0.05
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.15, summary
    assert "exact-match accuracy on 200 held-out problems" in done.stderr
    for produced in ("loss_curve.png", "metrics.jsonl", "config.yaml", "hf/model.safetensors"):
        assert (out / produced).is_file(), produced
    assert any((out / "tensorboard").iterdir())
    cached = cached_sft_model(tmp_path / "cache")
    assert cached is not None and (cached / "config.json").is_file()
