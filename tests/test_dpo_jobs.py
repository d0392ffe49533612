"""`drivetrain dpo` on a tiny model with each kind of reference: a frozen engine, the actor
with its LoRA adapter off, precomputed log-probs, and none (SimPO)."""

from __future__ import annotations

import json

import pytest

from cli_run import run_cli
from drivetrain.trainer.builtin.addition import preference_rows
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from sft_support import sft_env

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize(
    ("extra", "reference"),
    [
        ([], "engine"),
        (["engine.model.lora.rank=4", "engine.optim.lr=0.01"], "adapter"),
        (["reference.mode=precomputed"], "precomputed"),
        (["algorithm.loss=simpo", "algorithm.beta=2.0"], "none"),
    ],
)
def test_dpo_job_with_each_reference(tmp_path, extra, reference):
    model = build_tiny_chat_model(tmp_path / "model")
    rows = preference_rows(16, seed=0)
    for i, row in enumerate(rows):  # only read with reference.mode=precomputed
        row.update(ref_chosen_logps=-1.0 - i % 3, ref_rejected_logps=-2.0)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    command = [
        "dpo", f"engine.model.path={model}",
        f"data.train_path={data}", f"data.val_path={data}", f"run.output_dir={out}",
        "run.max_steps=3", "run.batch_size=4", "engine.optim.lr=0.001",
        "engine.micro_batch.max_tokens=100", "logging.progress=false",
        "logging.tensorboard=false", *extra,
    ]  # fmt: skip
    done = run_cli(*command, env=sft_env(tmp_path), timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"reference {reference}" in done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and (out / "hf" / "config.json").is_file()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 3 and all("train/rewards/margins" in r for r in train)
    if reference in ("engine", "adapter"):  # the reference is the starting policy
        assert train[0]["train/loss"] == pytest.approx(0.6931, abs=1e-3)
        assert summary["val_before"]["val/rewards/margins"] == pytest.approx(0.0, abs=1e-5)
