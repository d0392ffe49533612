"""Off-policy corrections (TIS, masked IS, sequence masking, sequence ratio) against values
computed by hand, padded and packed, and the actor loss weighting its tokens with them (from
the old log-probs column, or its own forward's when it is the only update)."""

from __future__ import annotations

import math

import pytest
import torch

from drivetrain.api import Batch, LossContext
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.rl.off_policy import (
    CORRECTIONS,
    CorrectionConfig,
    CorrectionInputs,
    correct,
)
from drivetrain.trainer.rl.update_losses import ActorLoss

LN = math.log
# two sequences: a prompt token (masked) then three response tokens; the second has a pad
MASK = torch.tensor([[0.0, 1, 1, 1], [0.0, 1, 1, 0]])
ROLLOUT = torch.tensor([[0.0, LN(0.5), LN(0.2), LN(0.4)], [0.0, LN(0.5), LN(0.1), 0.0]])
# trainer/rollout probability ratios: row 1: 0.8, 3.0, 0.25; row 2: 1.2, 1.5
OLD = torch.tensor([[0.0, LN(0.4), LN(0.6), LN(0.1)], [0.0, LN(0.6), LN(0.15), 7.0]])
INPUTS = CorrectionInputs(OLD, ROLLOUT, MASK, seq_lens=[4, 3])
CONFIG = CorrectionConfig(cap=2.0, low=0.5, high=2.0)


def weights(name: str, config: CorrectionConfig = CONFIG) -> tuple[list[list[float]], dict]:
    w, metrics = correct(name, INPUTS, config)
    return w.tolist(), floats(metrics)


def floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


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


@pytest.mark.parametrize("name", ["tis", "icepop", "seq_mask", "seq_tis"])
def test_packed_layout_gives_the_padded_weights(name: str) -> None:
    keep = MASK.new_tensor([1, 1, 1, 1, 1, 1, 1, 0]).bool()  # the padded rows, pad left out
    packed = CorrectionInputs(
        OLD.flatten()[keep], ROLLOUT.flatten()[keep], MASK.flatten()[keep], seq_lens=[4, 3]
    )
    config = CorrectionConfig(cap=1.0, low=0.9, high=2.0)
    padded_w, padded_metrics = correct(name, INPUTS, config)
    packed_w, packed_metrics = correct(name, packed, config)
    assert packed_w.tolist() == pytest.approx(padded_w.flatten()[keep].tolist())
    assert floats(packed_metrics) == pytest.approx(floats(padded_metrics))


def test_metrics_are_shares_of_the_global_counts() -> None:
    """Per micro-batch, the loss reports its share: shares of two halves sum to the whole."""
    _, whole = correct("seq_tis", INPUTS, CorrectionConfig(cap=1.0))
    halves = [
        correct("seq_tis", CorrectionInputs(OLD[i : i + 1], ROLLOUT[i : i + 1], MASK[i : i + 1],
                                            [[4, 3][i]]),
                CorrectionConfig(cap=1.0), global_tokens=5, global_sequences=2)[1]
        for i in range(2)
    ]  # fmt: skip
    for key, value in whole.items():
        if key.endswith("_max"):
            assert max(float(h[key]) for h in halves) == pytest.approx(float(value))
        else:
            assert sum(float(h[key]) for h in halves) == pytest.approx(float(value)), key


def _batch(old: torch.Tensor, advantages: torch.Tensor) -> Batch:
    columns = {
        "input_ids": torch.zeros(2, 4, dtype=torch.long),
        "loss_mask": MASK.long(),
        "old_log_probs": old,
        "rollout_log_probs": ROLLOUT,
        "advantages": advantages,
    }
    return Batch.from_columns(columns, seq_lens=[4, 3], token_keys=list(columns))


CTX = LossContext(global_tokens=5, global_sequences=2, dp_size=1, micro_batch_index=0,
                  num_micro_batches=1)  # fmt: skip
ADVANTAGES = torch.tensor([[0.0, 1, 1, 1], [0.0, -1, -1, 0]])


def test_actor_loss_weights_each_token_with_the_correction() -> None:
    """The policy loss of token t is multiplied by its weight: a weight of 0 removes the
    token's gradient, 2 doubles it (token-mean over the 5 response tokens)."""
    log_probs = OLD.clone().requires_grad_(True)  # the update's first pass: ratio 1
    w, want_metrics = correct("icepop", INPUTS, CONFIG)
    loss_fn = ActorLoss(policy_loss="reinforce", correction="icepop", correction_config=CONFIG)
    outputs = {"log_probs": log_probs, "entropy": torch.zeros(2, 4)}
    loss, metrics = loss_fn(outputs, _batch(OLD, ADVANTAGES), CTX)
    loss.backward()
    # reinforce at ratio 1: d(-A w ratio)/d log_prob = -A w, over 5 tokens
    want = (-ADVANTAGES * w * MASK) / 5
    assert torch.allclose(log_probs.grad, want)
    assert float(loss.detach()) == pytest.approx(float(want.sum()))
    assert _off_policy(metrics) == pytest.approx(floats(want_metrics))


def test_on_policy_actor_loss_corrects_against_its_own_forward() -> None:
    """With one update per batch the loss's own log-probs are the proximal policy: the
    weights are the same as from an old_log_probs column holding them."""
    outputs = {"log_probs": OLD.clone().requires_grad_(True), "entropy": torch.zeros(2, 4)}
    on_policy = ActorLoss(correction="tis", on_policy=True)
    _, got = on_policy(outputs, _batch(torch.full((2, 4), 9.0), ADVANTAGES), CTX)  # unused
    _, want = ActorLoss(correction="tis")(outputs, _batch(OLD, ADVANTAGES), CTX)
    assert got["off_policy/is_weight_mean"] == pytest.approx((0.8 + 2 + 0.25 + 1.2 + 1.5) / 5)
    assert _off_policy(got) == pytest.approx(_off_policy(want))


def _off_policy(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if k.startswith("off_policy/")}
