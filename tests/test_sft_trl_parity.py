"""drivetrain's SFT loss curve equals TRL's SFTTrainer's on the same model, data and
hyper-parameters (fp32, 20 steps), while drivetrain packs sequences and TRL pads them."""

from __future__ import annotations

import pytest

from drivetrain.trainer.sft.config import DataConfig
from drivetrain.trainer.sft.dataset import tokenize_file
from sft_support import make_job, run_sft, train_losses
from trl_reference import trl_sft

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, LR = 20, 4, 3e-3


def test_loss_curve_matches_trl_sft_trainer(tmp_path):
    base = make_job(tmp_path, rows=STEPS * BATCH)
    overrides = [
        o for o in base if not o.startswith(("run.max_steps", "run.batch_size", "engine.optim.lr"))
    ]
    job = [
        *overrides,
        f"run.max_steps={STEPS}",
        f"run.batch_size={BATCH}",
        f"engine.optim.lr={LR}",
        "engine.optim.weight_decay=0.0",
        "engine.optim.clip_grad=1.0",
        "data.shuffle=false",
    ]
    run_sft(tmp_path, tmp_path / "ours", *job)
    ours = train_losses(tmp_path / "ours")

    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    examples, _ = tokenize_file(
        str(tmp_path / "train.jsonl"),
        AutoTokenizer.from_pretrained(str(model_dir)),
        DataConfig(train_path=str(tmp_path / "train.jsonl")),
    )
    theirs = trl_sft(
        model_dir, examples, batch_size=BATCH, steps=STEPS, lr=LR, out_dir=tmp_path / "trl"
    ).losses

    assert len(theirs) == len(ours) == STEPS
    diffs = [abs(ours[step + 1] - theirs[step]) for step in range(STEPS)]
    print(f"max |drivetrain - TRL| over {STEPS} steps: {max(diffs):.2e}")
    assert max(diffs) < 1e-4, list(zip(ours.values(), theirs, strict=True))
    assert ours[STEPS] < ours[1] - 0.5  # and it actually learns
