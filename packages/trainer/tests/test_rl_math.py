"""The RL math against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from drivetrain.api import Batch, LossContext
from drivetrain.api.batch import Layout
from drivetrain.trainer.rl.advantages import ADVANTAGES, AdvantageInputs
from drivetrain.trainer.rl.aggregation import aggregate
from drivetrain.trainer.rl.kl import KLConfig, kl_penalty
from drivetrain.trainer.rl.policy_losses import POLICY_LOSSES, ClipConfig, PolicyLossInputs
from drivetrain.trainer.rl.update_losses import ActorLoss, CriticLoss, state_values


def test_grpo_group_advantages() -> None:
    # two prompts, three samples each; reward on the last response token
    mask = torch.tensor([[0, 1, 1]] * 6, dtype=torch.float64)
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0, 5.0], dtype=torch.float64)
    rewards = torch.zeros(6, 3, dtype=torch.float64)
    rewards[:, 2] = scores
    inputs = AdvantageInputs(rewards, mask, [7, 7, 7, 3, 3, 3], eps=0.0)
    adv, _ = ADVANTAGES.get("grpo")(inputs)
    # group 1: mean 1/3, unbiased std sqrt(1/3); group 2: mean 3, std sqrt(3)
    s1, s2 = math.sqrt(1 / 3), math.sqrt(3.0)
    want = [(1 - 1 / 3) / s1, (-1 / 3) / s1, (-1 / 3) / s1, -1 / s2, -1 / s2, 2 / s2]
    assert adv[:, 1].tolist() == pytest.approx(want)
    assert adv[:, 2].tolist() == pytest.approx(want)
    assert adv[:, 0].abs().sum() == 0  # prompt token
    plain, _ = ADVANTAGES.get("grpo")(
        AdvantageInputs(rewards, mask, [7, 7, 7, 3, 3, 3], norm_by_std=False)
    )
    assert plain[:, 2].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1, -1, 2])


def test_grpo_group_of_one_and_equal_rewards() -> None:
    mask = torch.ones(3, 1, dtype=torch.float64)
    rewards = torch.tensor([[1.0], [1.0], [4.0]], dtype=torch.float64)
    adv, _ = ADVANTAGES.get("grpo")(AdvantageInputs(rewards, mask, [0, 0, 1]))
    # equal rewards: no signal; a group of one: mean 0, std 1 (its score passes through)
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.0, 4.0 / (1 + 1e-6)])


def test_rloo_leave_one_out() -> None:
    mask = torch.ones(3, 1, dtype=torch.float64)
    rewards = torch.tensor([[3.0], [0.0], [0.0]], dtype=torch.float64)
    adv, _ = ADVANTAGES.get("rloo")(AdvantageInputs(rewards, mask, [0, 0, 0]))
    assert adv[:, 0].tolist() == pytest.approx([3.0, -1.5, -1.5])


def test_gae_by_hand() -> None:
    # one sequence: prompt token, then 3 response tokens; reward 1 at the end
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.float64)
    rewards = torch.tensor([[0, 0, 0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7]], dtype=torch.float64)  # prompt value ignored
    gamma, lam = 0.9, 0.8
    adv, returns = ADVANTAGES.get("gae")(
        AdvantageInputs(rewards, mask, [0], values=values, gamma=gamma, lam=lam)
    )
    d3 = 1.0 - 0.7
    d2 = 0 + gamma * 0.7 - 0.6
    d1 = 0 + gamma * 0.6 - 0.5
    a3 = d3
    a2 = d2 + gamma * lam * a3
    a1 = d1 + gamma * lam * a2
    assert returns[0].tolist() == pytest.approx([0, a1 + 0.5, a2 + 0.6, a3 + 0.7])
    raw = torch.tensor([a1, a2, a3], dtype=torch.float64)
    whitened = (raw - raw.mean()) / raw.std()
    assert adv[0, 1:].tolist() == pytest.approx(whitened.tolist(), rel=1e-5)
    assert adv[0, 0] == 0


def test_kl_estimators() -> None:
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    r = ref - logp  # [-0.5, 1.0]
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    k3 = [math.exp(x) - 1 - x for x in r.tolist()]
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(k3)
    assert kl_penalty(logp, logp, "k3").abs().sum() == 0
    with pytest.raises(ValueError, match="k9"):
        kl_penalty(logp, ref, "k9")


def test_clipped_surrogate_and_dual_clip() -> None:
    ratio = torch.tensor([1.5, 0.5, 1.1, 5.0, 1.5])
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0, -1.0])
    inputs = PolicyLossInputs(ratio.log(), torch.zeros(5), adv, torch.ones(5), [5])
    loss, metrics = POLICY_LOSSES.get("vanilla")(inputs, ClipConfig(0.2, 0.2, 3.0))
    # 1.5, A=1: min(1.5, 1.2) -> -1.2 ; 0.5, A=1: min(0.5, 0.8)=0.5 -> -0.5 (no clip)
    # 1.1, A=-2: max(2.2, 2.2)=2.2 ; 5.0, A=-1: max(5, 1.2)=5, dual cap 3 -> 3
    # 1.5, A=-1: max(1.5, 1.2)=1.5 (below the cap of 3)
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 2.2, 3.0, 1.5])
    assert metrics["clip_frac"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert metrics["dual_clip_frac"].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0]
    higher, _ = POLICY_LOSSES.get("vanilla")(inputs, ClipConfig(0.2, 0.28, 0.0))
    assert higher.tolist() == pytest.approx([-1.28, -0.5, 2.2, 5.0, 1.5])


def test_gspo_sequence_ratio() -> None:
    # one sequence of two tokens with log-ratios 0.2 and 0.0: sequence ratio exp(0.1)
    logp = torch.tensor([[0.2, 0.0]], requires_grad=True)
    inputs = PolicyLossInputs(logp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2), [2])
    loss, _ = POLICY_LOSSES.get("gspo")(inputs, ClipConfig(1.0, 1.0, 0.0))
    assert loss.tolist()[0] == pytest.approx([-math.exp(0.1)] * 2)


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        # tokens: seq A has 1,2 (2 tokens), seq B has 3 (1 token; its 2nd is masked)
        ("token-mean", (1 + 2 + 3) / 3),
        ("seq-mean-token-sum", ((1 + 2) + 3) / 2),
        ("seq-mean-token-mean", ((1 + 2) / 2 + 3 / 1) / 2),
        ("seq-mean-token-sum-norm", (1 + 2 + 3) / (2 * 4)),  # Dr. GRPO: max_length 4
    ],
)
def test_aggregation_modes_padded_and_packed(mode: str, want: float) -> None:
    loss = torch.tensor([[1.0, 2.0], [3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    counts = {"seq_lens": [2, 2], "global_tokens": 3, "global_sequences": 2, "max_length": 4}
    padded = aggregate(loss, mask, mode, **counts)
    packed = aggregate(loss.flatten(), mask.flatten(), mode, **counts)
    assert float(padded) == pytest.approx(want)
    assert float(packed) == pytest.approx(want)


def test_aggregation_shares_sum_over_micro_batches() -> None:
    loss = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    whole = aggregate(loss, mask, "seq-mean-token-mean", seq_lens=[2] * 3, global_tokens=5,
                      global_sequences=3)  # fmt: skip
    parts = sum(
        aggregate(
            loss[i : i + 1],
            mask[i : i + 1],
            "seq-mean-token-mean",
            seq_lens=[2],
            global_tokens=5,
            global_sequences=3,
        )
        for i in range(3)
    )
    assert float(parts) == pytest.approx(float(whole))


def _ctx(tokens: int, seqs: int) -> LossContext:
    return LossContext(tokens, seqs, 1, 0, 1)


def test_actor_loss_combines_terms() -> None:
    logp = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.0, 0.5, 1.5]])
    batch = Batch.from_columns(
        {
            "input_ids": torch.zeros(1, 3, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 1, 1]]),
            "old_log_probs": torch.tensor([[0.0, -1.0, -2.0]]),
            "advantages": torch.tensor([[0.0, 2.0, -1.0]]),
            "ref_log_probs": torch.tensor([[0.0, -1.5, -2.0]]),
        },
        seq_lens=[3],
        token_keys=["input_ids", "loss_mask", "old_log_probs", "advantages", "ref_log_probs"],
    )
    loss_fn = ActorLoss(entropy_coef=0.1, kl=KLConfig(coef=0.5, estimator="k3"))
    loss, metrics = loss_fn({"log_probs": logp, "entropy": entropy}, batch, _ctx(2, 1))
    pg = (-2.0 + 1.0) / 2  # ratio 1: -A
    ent = (0.5 + 1.5) / 2
    kl = (math.exp(-0.5) - 1 + 0.5 + 0.0) / 2
    assert float(loss.detach()) == pytest.approx(pg - 0.1 * ent + 0.5 * kl)
    assert float(metrics["actor/pg_loss"]) == pytest.approx(pg)
    assert float(metrics["actor/kl_loss"]) == pytest.approx(kl)
    loss.backward()
    assert logp.grad is not None and logp.grad[0, 0] == 0  # prompt token gets no gradient


def test_critic_loss_clipped_and_shifted() -> None:
    # value head outputs at positions 0..2; V(state before token t) is the output at t - 1
    values_out = torch.tensor([[1.0, 2.0, 0.0]], requires_grad=True)
    assert state_values(values_out.detach()).tolist() == [[0.0, 1.0, 2.0]]
    batch = Batch.from_columns(
        {
            "input_ids": torch.zeros(1, 3, dtype=torch.long),
            "loss_mask": torch.tensor([[0, 1, 1]]),
            "returns": torch.tensor([[0.0, 1.5, 1.0]]),
            "old_values": torch.tensor([[0.0, 0.0, 2.0]]),
        },
        seq_lens=[3],
        token_keys=["input_ids", "loss_mask", "returns", "old_values"],
    )
    loss, _ = CriticLoss(clip_range=0.5)({"values": values_out}, batch, _ctx(2, 1))
    # token 1: V=1, old=0 -> clipped 0.5; max((1-1.5)², (0.5-1.5)²) = 1
    # token 2: V=2, old=2 -> same; (2-1)² = 1
    assert float(loss.detach()) == pytest.approx(0.5 * (1.0 + 1.0) / 2)


def test_packed_layout_actor_loss_matches_padded() -> None:
    cols = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long),
        "loss_mask": torch.tensor([[0, 1, 1], [0, 1, 0]]),
        "old_log_probs": torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]]),
        "advantages": torch.tensor([[0.0, 1.0, 1.0], [0.0, -1.0, 0.0]]),
    }
    logp = torch.tensor([[0.0, -0.8, -2.1], [0.0, -0.4, 0.0]])
    padded = Batch.from_columns(cols, seq_lens=[3, 3], token_keys=list(cols))
    packed = padded.to_packed()
    assert packed.layout is Layout.PACKED
    fn = ActorLoss(aggregation="seq-mean-token-mean")
    ent = torch.rand(2, 3)
    a, _ = fn({"log_probs": logp, "entropy": ent}, padded, _ctx(3, 2))
    b, _ = fn({"log_probs": logp.flatten(), "entropy": ent.flatten()}, packed, _ctx(3, 2))
    assert float(a) == pytest.approx(float(b))


def test_on_policy_actor_loss_equals_recomputed_old_log_probs() -> None:
    logp = torch.tensor([[0.0, -0.7, -1.2]], requires_grad=True)
    cols = {
        "input_ids": torch.zeros(1, 3, dtype=torch.long),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "old_log_probs": logp.detach().clone(),
        "advantages": torch.tensor([[0.0, 1.5, 1.5]]),
    }
    batch = Batch.from_columns(cols, seq_lens=[3], token_keys=list(cols))
    outputs = {"log_probs": logp, "entropy": torch.zeros(1, 3)}
    recomputed, _ = ActorLoss()(outputs, batch, _ctx(2, 1))
    shortcut, _ = ActorLoss(on_policy=True)(outputs, batch.drop("old_log_probs"), _ctx(2, 1))
    assert float(shortcut.detach()) == pytest.approx(float(recomputed.detach()))
    g1 = torch.autograd.grad(recomputed, logp, retain_graph=True)[0]
    g2 = torch.autograd.grad(shortcut, logp)[0]
    assert torch.equal(g1, g2)


def test_digit_match_credits_aligned_digits():
    from drivetrain.trainer.rl.rewards import digit_match

    assert digit_match("46", "46") == 1.0
    assert digit_match("47", "46") == 0.5  # tens right, units wrong
    assert digit_match("146", "46") == pytest.approx(2 / 3)  # aligned from the units digit
    assert digit_match("no number", "46") == 0.0


def test_a_policy_loss_reading_the_old_clip_fields_is_told_the_new_ones() -> None:
    with pytest.raises(AttributeError, match=r"ClipConfig.clip_high is now ClipConfig.high"):
        ClipConfig().clip_high  # noqa: B018
