"""Off-policy corrections (TIS, masked IS, sequence masking, sequence ratio) against values
computed by hand, and the actor loss weighting its tokens with them."""

from __future__ import annotations

import math

import pytest
import torch

from drivetrain.api import Batch, LossContext
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.rl.losses import ActorLoss
from drivetrain.trainer.rl.off_policy import (
    CORRECTIONS,
    IS_WEIGHTS,
    CorrectionConfig,
    CorrectionInputs,
    correct,
)

LN = math.log
# two sequences: a prompt token (masked) then three response tokens; the second has a pad
MASK = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 0]])
ROLLOUT = torch.tensor([[0.0, LN(0.5), LN(0.2), LN(0.4)], [0.0, LN(0.5), LN(0.1), 0.0]])
# trainer/rollout probability ratios: row 1: 0.8, 3.0, 0.25; row 2: 1.2, 1.5
OLD = torch.tensor([[0.0, LN(0.4), LN(0.6), LN(0.1)], [0.0, LN(0.6), LN(0.15), 7.0]])
INPUTS = CorrectionInputs(OLD, ROLLOUT, MASK)
CONFIG = CorrectionConfig(cap=2.0, low=0.5, high=2.0)


def weights(name: str, config: CorrectionConfig = CONFIG) -> tuple[list[list[float]], dict]:
    w, metrics = correct(name, INPUTS, config)
    return w.tolist(), metrics


def test_truncated_is_caps_each_token() -> None:
    w, metrics = weights("tis")
    assert w[0] == pytest.approx([0.0, 0.8, 2.0, 0.25])
    assert w[1] == pytest.approx([0.0, 1.2, 1.5, 0.0])  # the pad stays 0
    assert metrics["off_policy/truncated_frac"] == pytest.approx(1 / 5)
    assert metrics["off_policy/is_weight_mean"] == pytest.approx((0.8 + 2 + 0.25 + 1.2 + 1.5) / 5)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(2.0)
    assert metrics["off_policy/masked_frac"] == 0.0
    gap = (abs(LN(0.8)) + LN(3) + abs(LN(0.25)) + LN(1.2) + LN(1.5)) / 5
    assert metrics["off_policy/log_prob_gap"] == pytest.approx(gap)


def test_icepop_masks_tokens_outside_the_band() -> None:
    w, metrics = weights("icepop")
    assert w[0] == pytest.approx([0.0, 0.8, 0.0, 0.0])  # 3.0 > 2 and 0.25 < 0.5 masked
    assert w[1] == pytest.approx([0.0, 1.2, 1.5, 0.0])
    assert metrics["off_policy/masked_frac"] == pytest.approx(2 / 5)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(1.5)


def test_sequence_mask_uses_the_geometric_mean_ratio() -> None:
    # row 1: (0.8 * 3 * 0.25) ** (1/3) = 0.843; row 2: (1.2 * 1.5) ** (1/2) = 1.342
    w, metrics = weights("seq_mask", CorrectionConfig(low=0.9, high=2.0))
    assert w[0] == [0.0, 0.0, 0.0, 0.0]
    assert w[1] == [0.0, 1.0, 1.0, 0.0]
    assert metrics["off_policy/masked_sequences_frac"] == 0.5
    w, _ = weights("seq_mask", CorrectionConfig(low=0.8, high=1.3))
    assert w == [[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]


def test_sequence_tis_puts_the_truncated_geometric_mean_on_every_token() -> None:
    g1, g2 = (0.8 * 3 * 0.25) ** (1 / 3), (1.2 * 1.5) ** 0.5
    w, _ = weights("seq_tis")
    assert w[0] == pytest.approx([0.0, g1, g1, g1])
    assert w[1] == pytest.approx([0.0, g2, g2, 0.0])
    w, metrics = weights("seq_tis", CorrectionConfig(cap=1.0))
    assert w[1] == pytest.approx([0.0, 1.0, 1.0, 0.0])
    assert metrics["off_policy/truncated_sequences_frac"] == 0.5


def test_none_and_unknown() -> None:
    w, _ = weights("none")
    assert w == MASK.tolist()
    with pytest.raises(ConfigError, match="unknown off-policy correction 'nope'; registered: "):
        CORRECTIONS.get("nope")


def test_actor_loss_weights_each_token_with_the_correction() -> None:
    """The policy loss of token t is multiplied by its weight: a weight of 0 removes the
    token's gradient, 2 doubles it (token-mean over the 5 response tokens)."""
    log_probs = torch.zeros(2, 4, requires_grad=True)
    advantages = torch.tensor([[0.0, 1, 1, 1], [0.0, -1, -1, 0]])
    w, _ = correct("icepop", INPUTS, CONFIG)
    columns = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "loss_mask": MASK.long(),
        "old_log_probs": torch.zeros(2, 4),
        "advantages": advantages,
        IS_WEIGHTS: w,
    }
    batch = Batch.from_columns(columns, seq_lens=[4, 3], token_keys=list(columns))
    ctx = LossContext(global_tokens=5, global_sequences=2, dp_size=1, micro_batch_index=0,
                      num_micro_batches=1)  # fmt: skip
    loss_fn = ActorLoss(policy_loss="reinforce")
    loss, _ = loss_fn({"log_probs": log_probs, "entropy": torch.zeros(2, 4)}, batch, ctx)
    loss.backward()
    # reinforce at ratio 1: d(-A w ratio)/d log_prob = -A w, over 5 tokens
    want = (-advantages * w * MASK) / 5
    assert torch.allclose(log_probs.grad, want)
    assert float(loss) == pytest.approx(float(want.sum()))
