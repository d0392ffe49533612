"""The README's first job: `drivetrain sft` with no arguments trains the built-in model on the
addition task, and its exact-match accuracy rises well above the untrained model's.

The run checked here is the one `drivetrain grpo` chains on an empty cache (``builtin_addition``
in conftest.py): the same job (``load_sft_job`` with the built-in task and no overrides), so
the SFT default trains once per test session. The command's own summary line is checked on a
short run of the same built-in job in ``test_builtin_sft_command_reports_accuracy``."""

from __future__ import annotations

import json

import pytest

from builtin_run import BUILTIN_ADDITION
from cli_run import run_cli
from drivetrain.trainer.builtin.addition import SFT_REPORT, cached_sft_model
from golden import check_golden

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500), BUILTIN_ADDITION]


def test_default_sft_job(builtin_addition):
    out = builtin_addition.sft_out
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if "train/loss" in r) == 600
    check_golden("sft_builtin", rows, steps=10)
    for produced in ("loss_curve.png", "metrics.jsonl", "config.yaml", "hf/model.safetensors"):
        assert (out / produced).is_file(), produced
    assert any((out / "tensorboard").iterdir())
    cached = cached_sft_model(builtin_addition.cache)
    assert cached is not None and (cached / "config.json").is_file()
    report = json.loads((cached / SFT_REPORT).read_text())
    assert report["test_examples"] == 200
    assert report["accuracy_before"] < 0.05
    assert report["accuracy_after"] >= report["accuracy_before"] + 0.15, report


def test_builtin_sft_command_reports_accuracy(tmp_path, builtin_addition):
    """`drivetrain sft` on the built-in task prints the held-out accuracy before and after and
    ends with it in its JSON summary (a short run: only the default run is cached)."""
    out = tmp_path / "run"
    args = ["sft", f"run.output_dir={out}", "run.max_steps=20", "logging.progress=false"]
    done = run_cli(*args, env=builtin_addition.env(), timeout=600)  # assets built already
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["test_examples"] == 200
    assert 0 <= summary["accuracy_before"] < 0.05 and 0 <= summary["accuracy_after"] <= 1
    assert "exact-match accuracy on 200 held-out problems" in done.stderr
    assert (out / "hf" / "model.safetensors").is_file()
