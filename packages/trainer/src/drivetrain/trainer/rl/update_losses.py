"""The actor's and the critic's loss functions, as picklable objects handed to every engine
rank (``engine.forward_backward(batch, loss, outputs=...)``): Ray workers receive them with
the mini-batch.

Metrics are returned as each micro-batch's share of the mini-batch mean (divided by the
global counts), so the engine's sum over micro-batches and ranks is the mini-batch value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from drivetrain.api import Batch, LossContext, OutputSpec
from drivetrain.api.columns import (
    ADVANTAGES,
    ENTROPY,
    LOG_PROBS,
    LOSS_MASK,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    VALUES,
)
from drivetrain.trainer.rl.aggregation import aggregate
from drivetrain.trainer.rl.batch_ops import CURRENT_WEIGHTS
from drivetrain.trainer.rl.kl import KLConfig, kl_penalty
from drivetrain.trainer.rl.off_policy import CorrectionConfig, CorrectionInputs, correct
from drivetrain.trainer.rl.policy_losses import POLICY_LOSSES, ClipConfig, PolicyLossInputs
from drivetrain.trainer.rl.routing import ROLLOUT_ROUTED_EXPERTS, mismatch_metrics

OLD_VALUES = "old_values"  # the critic's values before this update (value clipping)


def state_values(values: torch.Tensor) -> torch.Tensor:
    """``V(tokens < t)`` at every position ``t``: a value head's output at ``t`` has seen token
    ``t``, so the value of the state that *chose* token ``t`` is the output at ``t - 1``. The
    shift crosses into the previous sequence only at a sequence's first token, which is a
    prompt token and never in the loss."""
    shifted = torch.roll(values, 1, dims=-1)
    shifted[..., 0] = 0.0
    return shifted


@dataclass(frozen=True)
class ActorLoss:
    policy_loss: str = "vanilla"
    clip: ClipConfig = field(default_factory=ClipConfig)
    aggregation: str = "token-mean"
    max_length: int = 0  # seq-mean-token-sum-norm's fixed normaliser (sampling.max_new_tokens)
    entropy_coef: float = 0.0
    kl: KLConfig = field(default_factory=KLConfig)  # a loss term unless in the reward
    temperature: float = 1.0
    #: one update per batch: the old log-probs are this pass's own (detached), so no separate
    #: forward computes them (the ratio is 1)
    on_policy: bool = False
    #: the off-policy correction of the rollout↔trainer gap (rl/off_policy.py), per token
    correction: str = "none"
    correction_config: CorrectionConfig = field(default_factory=CorrectionConfig)
    #: the step's first optimizer update: its log-probs and the old ones come from the same
    #: weights, so their ratio is 1 up to numerics (``actor/first_update_log_ratio_max``)
    first_update: bool = False
    #: the batch's ``routed_experts`` are replayed (``algorithm.routing_replay``)
    replay_routing: bool = False
    #: the rollout reports routing: the update asks which experts its forward used and reports
    #: how often they differ from the rollout's (``routing/mismatch_share``)
    routing_metrics: bool = False
    #: the batch columns it reads beside the engine's own, where the batch has them: what an
    #: update sends
    reads: ClassVar[tuple[str, ...]] = (
        OLD_LOG_PROBS,
        ADVANTAGES,
        REF_LOG_PROBS,
        ROLLOUT_LOG_PROBS,
        CURRENT_WEIGHTS,
        ROLLOUT_ROUTED_EXPERTS,
    )

    @property
    def outputs(self) -> OutputSpec:
        return OutputSpec(
            log_probs=True,
            entropy=True,
            temperature=self.temperature,
            routed_experts=self.routing_metrics,
        )

    @property
    def replays(self) -> tuple[str, ...]:
        """Columns the engine itself reads for this loss: the routing it replays."""
        return (ROUTED_EXPERTS,) if self.replay_routing else ()

    def __call__(
        self, outputs: Mapping[str, Any], mb: Batch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        log_probs = outputs[LOG_PROBS]
        mask = mb[LOSS_MASK].to(log_probs.dtype)

        def agg(per_token: torch.Tensor, mode: str | None = None) -> torch.Tensor:
            return aggregate(
                per_token,
                mask,
                mode or self.aggregation,
                seq_lens=mb.seq_lens,
                global_tokens=ctx.global_tokens,
                global_sequences=ctx.global_sequences,
                max_length=self.max_length,
            )

        old = log_probs.detach() if self.on_policy else mb[OLD_LOG_PROBS].to(log_probs.dtype)
        inputs = PolicyLossInputs(
            log_probs=log_probs,
            old_log_probs=old,
            advantages=mb[ADVANTAGES].to(log_probs.dtype),
            mask=mask,
            seq_lens=mb.seq_lens,
        )
        per_token, indicators = POLICY_LOSSES.get(self.policy_loss)(inputs, self.clip)
        metrics: dict[str, Any] = {}
        if self.correction != "none":  # per-token weights, no gradient through them
            gap = CorrectionInputs(old, mb[ROLLOUT_LOG_PROBS].to(old.dtype), mask, mb.seq_lens)
            weights, corrected = correct(
                self.correction,
                gap,
                self.correction_config,
                global_tokens=ctx.global_tokens,
                global_sequences=ctx.global_sequences,
            )
            per_token = per_token * weights.to(per_token.dtype)
            metrics.update(corrected)
        policy = agg(per_token)
        loss = policy
        metrics["actor/pg_loss"] = policy.detach()
        for name, value in indicators.items():
            metrics[f"actor/{name}"] = agg(value.detach(), "token-mean")
        approx_kl = (inputs.old_log_probs - log_probs.detach()) * mask
        metrics["actor/ppo_kl"] = agg(approx_kl, "token-mean")
        entropy = agg(outputs[ENTROPY])
        metrics["actor/entropy"] = entropy.detach()
        if ROLLOUT_LOG_PROBS in mb:  # the rollout sampled from the weights being trained
            diff = (mb[ROLLOUT_LOG_PROBS].to(log_probs.dtype) - log_probs.detach()).abs()
            metrics["actor/rollout_log_prob_diff"] = agg(diff, "token-mean")
            metrics["actor/rollout_log_prob_diff_max"] = (diff * mask).max()
        if CURRENT_WEIGHTS in mb and ROLLOUT_LOG_PROBS in mb:  # async: the current version's
            # tokens against the trainer's log-probs under the same weights
            gap = (mb[ROLLOUT_LOG_PROBS].to(old.dtype) - old).abs() * mb[CURRENT_WEIGHTS]
            metrics["actor/current_weights_log_prob_diff_max"] = gap.max()
        if self.routing_metrics and ROLLOUT_ROUTED_EXPERTS in mb:
            used, rollout = outputs[ROUTED_EXPERTS], mb[ROLLOUT_ROUTED_EXPERTS]
            metrics.update(mismatch_metrics(used, rollout, mask, ctx.global_tokens))
        if self.first_update and not self.on_policy:  # (on-policy, old is this very forward)
            gap = (log_probs.detach() - old).abs() * mask
            metrics["actor/first_update_log_ratio_max"] = gap.max()
        if self.entropy_coef != 0.0:
            loss = loss - self.entropy_coef * entropy
        # on-policy, this pass is the old policy: KL(old ‖ ref) is measured here, since the
        # controller has no old log-probs to measure it with
        measure_kl = self.on_policy and REF_LOG_PROBS in mb
        if self.kl.loss_coef != 0.0 or measure_kl:
            ref = mb[REF_LOG_PROBS].to(log_probs.dtype)
            kl = kl_penalty(log_probs, ref, self.kl.estimator)
            if measure_kl:
                metrics["actor/kl_ref"] = agg(kl.detach(), "token-mean")
            if self.kl.loss_coef != 0.0:
                kl_loss = agg(kl)
                loss = loss + self.kl.loss_coef * kl_loss
                metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


@dataclass(frozen=True)
class CriticLoss:
    """Clipped value loss ``½ max((V - R)², (V_old + clip(V - V_old, ±ε) - R)²)``."""

    #: columns the engine itself reads for this loss (as :attr:`ActorLoss.replays`): none
    replays: ClassVar[tuple[str, ...]] = ()

    clip_range: float = 0.5  # 0 disables value clipping
    aggregation: str = "token-mean"
    max_length: int = 0  # seq-mean-token-sum-norm's fixed normaliser
    reads: ClassVar[tuple[str, ...]] = (RETURNS, OLD_VALUES)  # beside the engine's own

    @property
    def outputs(self) -> OutputSpec:
        return OutputSpec(log_probs=False, values=True)

    def __call__(
        self, outputs: Mapping[str, Any], mb: Batch, ctx: LossContext
    ) -> tuple[torch.Tensor, Mapping[str, Any]]:
        values = state_values(outputs[VALUES])
        mask = mb[LOSS_MASK].to(values.dtype)
        returns = mb[RETURNS].to(values.dtype)
        loss = (values - returns).square()
        if self.clip_range > 0:
            old = mb[OLD_VALUES].to(values.dtype)
            clipped = old + (values - old).clamp(-self.clip_range, self.clip_range)
            loss = torch.maximum(loss, (clipped - returns).square())
        loss = 0.5 * loss

        def agg(per_token: torch.Tensor, mode: str) -> torch.Tensor:
            return aggregate(
                per_token,
                mask,
                mode,
                seq_lens=mb.seq_lens,
                global_tokens=ctx.global_tokens,
                global_sequences=ctx.global_sequences,
                max_length=self.max_length,
            )

        value_loss = agg(loss, self.aggregation)
        return value_loss, {
            "critic/value_loss": value_loss.detach(),
            "critic/values_mean": agg(values.detach(), "token-mean"),
        }
