"""drivetrain's DPO loss curve equals TRL's DPOTrainer's on the same model, pairs and
hyper-parameters (fp32, 10 steps), while drivetrain packs each step's pairs into one row and
TRL pads them."""

from __future__ import annotations

import json

import pytest

from cli_run import run_cli
from drivetrain.trainer.builtin.addition import preference_rows
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from drivetrain.trainer.dpo.config import PreferenceDataConfig
from drivetrain.trainer.dpo.data import load_pairs
from sft_support import sft_env, train_losses
from trl_reference import trl_dpo

pytestmark = pytest.mark.timeout(600)

STEPS, BATCH, LR = 10, 4, 1e-2


@pytest.mark.parametrize(("loss", "beta"), [("sigmoid", 0.1), ("ipo", 0.5)])
def test_loss_curve_matches_trl_dpo_trainer(tmp_path, loss, beta):

    from transformers import AutoTokenizer

    model = build_tiny_chat_model(tmp_path / "model")
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in preference_rows(STEPS * BATCH, 0)))
    out = tmp_path / "ours"
    command = [
        "dpo", f"engine.model.path={model}",
        f"data.train_path={data}", f"run.output_dir={out}", f"run.max_steps={STEPS}",
        f"run.batch_size={BATCH}", f"engine.optim.lr={LR}", "engine.optim.weight_decay=0.0",
        "engine.optim.clip_grad=1.0", "data.shuffle=false", f"algorithm.loss={loss}",
        f"algorithm.beta={beta}", "run.export_hf=false", "logging.progress=false",
        "logging.tensorboard=false",
    ]  # fmt: skip
    done = run_cli(*command, env=sft_env(tmp_path), timeout=540)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = train_losses(out)

    pairs = load_pairs(
        str(data), AutoTokenizer.from_pretrained(str(model)), PreferenceDataConfig(), None
    )
    theirs = trl_dpo(
        model, pairs, batch_size=BATCH, steps=STEPS, lr=LR, beta=beta, loss_type=loss,
        out_dir=tmp_path / "trl",
    ).losses  # fmt: skip

    assert len(theirs) == len(ours) == STEPS
    diffs = [abs(ours[step + 1] - theirs[step]) for step in range(STEPS)]
    print(f"{loss}: max |drivetrain - TRL| over {STEPS} steps: {max(diffs):.2e}")
    assert max(diffs) <= 1e-4, list(zip(ours.values(), theirs, strict=True))
    # the updates move the policy (a curve stuck at its first value would compare nothing)
    assert max(ours.values()) - min(ours.values()) > 1e-2
