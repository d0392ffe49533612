"""The stages a step's batch passes before the updates: old log-probs, reference, teacher,
reward model, values, advantages, the overlong filter. Each reads the columns before it and
adds its own (named in its docstring), and reports its metrics; :func:`build_stages` picks
the run's stages once, from its roles and config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from drivetrain.api import Batch, OutputSpec
from drivetrain.api.columns import (
    ENTROPY,
    LOG_PROBS,
    LOSS_MASK,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    ROLLOUT_LOG_PROBS,
    ROUTED_EXPERTS,
    VALUES,
)
from drivetrain.trainer.agentic.samples import turn_rewards
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.rl.advantages import ADVANTAGES as ESTIMATORS
from drivetrain.trainer.rl.advantages import AdvantageInputs
from drivetrain.trainer.rl.batch_ops import (
    engine_view,
    gather_outputs,
    group_ids,
    last_token_rewards,
    masked_mean,
)
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.dapo import filter_truncated
from drivetrain.trainer.rl.kl import kl_penalty
from drivetrain.trainer.rl.update_losses import OLD_VALUES, CriticLoss, state_values
from drivetrain.trainer.workers.group import WorkerGroup
from drivetrain.trainer.workers.role_worker import ACTOR, CRITIC, REWARD_MODEL, TEACHER

TEACHER_LOG_PROBS = "teacher_log_probs"  # on-policy distillation: the teacher's, per token


@dataclass
class StepBatch:
    """One step's batch on its way through the stages."""

    batch: Batch
    scores: torch.Tensor  # [B] each sample's reward (a reward model's score added)
    completions: Sequence[Any]
    played: Sequence[Any] | None  # episodes: rewards per turn
    reward_metrics: dict[str, float]
    metrics: dict[str, float] = field(default_factory=dict)  # the stages' own
    old_entropy: torch.Tensor | None = None  # the old log-probs' forward's entropy


class Stage:
    """One pass over the batch. ``phase`` names its time (``time/<phase>_s``; ``None``:
    untimed)."""

    phase: str | None = None

    def run(self, step: StepBatch) -> None:
        raise NotImplementedError

    def report(self, step: StepBatch) -> dict[str, float]:
        """Metrics of the final batch, after the updates (the loss mask the updates used)."""
        return {}


class _Inference(Stage):
    """A stage that asks a role's engines for per-token outputs."""

    def __init__(self, group: WorkerGroup, temperature: float) -> None:
        self.group, self.temperature = group, temperature

    def infer(
        self, batch: Batch, role: str, spec: OutputSpec, adapter_off: bool = False, *extra: str
    ) -> Any:
        return gather_outputs(self.group, engine_view(batch, *extra), role, spec, adapter_off)


class OldLogProbs(_Inference):
    """``old_log_probs``: the actor's, before the update (skipped on-policy: the update's own
    forward gives them). With routing replay (:mod:`~drivetrain.trainer.rl.routing`) its
    forward replays the rollout's routing (``rollout``), or routes itself and hands its
    routing to the updates as ``routed_experts`` (``old_policy``)."""

    phase = "old_log_probs"

    def __init__(self, group: WorkerGroup, temperature: float, routing_replay: str) -> None:
        super().__init__(group, temperature)
        self.routing_replay = routing_replay

    def run(self, step: StepBatch) -> None:
        hand_over = self.routing_replay == "old_policy"
        spec = OutputSpec(entropy=True, temperature=self.temperature, routed_experts=hand_over)
        replay = (ROUTED_EXPERTS,) if ROUTED_EXPERTS in step.batch else ()
        old = self.infer(step.batch, ACTOR, spec, False, *replay)
        step.batch = step.batch.with_columns(old_log_probs=old[LOG_PROBS])
        step.old_entropy = old[ENTROPY]
        if hand_over:  # the updates replay this forward's routing
            used = old[ROUTED_EXPERTS].to(torch.int16)  # (an empty shard's output is float)
            step.batch = step.batch.with_columns(**{ROUTED_EXPERTS: used})

    def report(self, step: StepBatch) -> dict[str, float]:
        assert step.old_entropy is not None
        mask = step.batch[LOSS_MASK]
        diff = (step.batch[ROLLOUT_LOG_PROBS] - step.batch[OLD_LOG_PROBS]).abs()
        return {
            "actor/entropy_old": masked_mean(step.old_entropy, mask),
            "rollout/log_prob_diff": masked_mean(diff, mask),
            "rollout/log_prob_diff_max": float((diff * mask).max()) if diff.numel() else 0.0,
        }


class ReferenceLogProbs(_Inference):
    """``ref_log_probs``: the reference policy's (its own engine, or the actor's adapter off)."""

    phase = "ref_log_probs"

    def __init__(self, group: WorkerGroup, temperature: float, reference: Reference) -> None:
        super().__init__(group, temperature)
        self.reference = reference

    def run(self, step: StepBatch) -> None:
        spec = OutputSpec(temperature=self.temperature)
        ref = self.infer(step.batch, self.reference.role, spec, self.reference.adapter_off)
        step.batch = step.batch.with_columns(ref_log_probs=ref[LOG_PROBS])


class TeacherLogProbs(_Inference):
    """``teacher_log_probs``: on-policy distillation's teacher scores every sampled token."""

    phase = "teacher_log_probs"

    def run(self, step: StepBatch) -> None:
        taught = self.infer(step.batch, TEACHER, OutputSpec(temperature=self.temperature))
        step.batch = step.batch.with_columns(
            teacher_log_probs=taught[LOG_PROBS], token_keys=[TEACHER_LOG_PROBS]
        )


class RewardModelScores(_Inference):
    """A value-head reward model's score of each sample's last token, added to its reward."""

    phase = "reward_model"

    def run(self, step: StepBatch) -> None:
        spec = OutputSpec(log_probs=False, values=True)
        values = self.infer(step.batch, REWARD_MODEL, spec)[VALUES]
        last = torch.as_tensor(step.batch.seq_lens) - 1
        scores = values[torch.arange(len(step.batch)), last].float()
        step.scores = step.scores + scores
        step.reward_metrics["reward/model_mean"] = float(scores.mean())


class Values(_Inference):
    """``old_values``: the critic's state values before its update."""

    phase = "values"

    def run(self, step: StepBatch) -> None:
        values = state_values(self.infer(step.batch, CRITIC, CriticLoss().outputs)[VALUES])
        step.batch = step.batch.with_columns(old_values=values, token_keys=[OLD_VALUES])


class Advantages(Stage):
    """``advantages`` and ``returns`` of the rewards, each on its sample's last token (or per
    turn for episodes), less the KL to the reference (in the reward) and the teacher's
    reverse KL (distillation)."""

    phase = "advantages"

    def __init__(self, config: RLConfig, on_policy: bool) -> None:
        self.config, self.on_policy = config, on_policy

    def run(self, step: StepBatch) -> None:
        alg, batch = self.config.algorithm, step.batch
        mask = batch[LOSS_MASK].float()
        if step.played is not None:
            rewards = turn_rewards(batch, step.played)
        else:
            rewards = last_token_rewards(batch, step.scores)
        if REF_LOG_PROBS in batch and not self.on_policy:
            # KL(old ‖ ref); on-policy, the old log-probs come from the update's own forward,
            # which reports it (the KL in the reward always has them: it turns on-policy off)
            kl = kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], alg.kl.estimator)
            step.metrics["actor/kl_ref"] = masked_mean(kl, mask)
            if alg.kl.in_reward:
                rewards = rewards - alg.kl.coef * kl * mask
        if TEACHER_LOG_PROBS in batch:  # on-policy distillation: -coef x reverse KL per token
            reverse_kl = (batch[OLD_LOG_PROBS] - batch[TEACHER_LOG_PROBS]) * mask
            rewards = rewards - self.config.teacher.coef * reverse_kl
            step.metrics["distill/reverse_kl"] = masked_mean(reverse_kl, mask)
        inputs = AdvantageInputs(
            token_rewards=rewards,
            mask=mask,
            group_ids=group_ids(batch),
            values=batch.columns.get(OLD_VALUES),
            gamma=alg.gamma,
            lam=alg.lam,
            norm_by_std=alg.norm_by_std,
        )
        adv, returns = ESTIMATORS.get(alg.advantage)(inputs)
        step.metrics["advantages/abs_mean"] = masked_mean(adv.abs(), mask)
        step.batch = batch.with_columns(advantages=adv.float(), returns=returns.float())


class OverlongFilter(Stage):
    """DAPO: truncated samples carry no loss (after the advantages: they keep their reward in
    their group's baseline)."""

    def run(self, step: StepBatch) -> None:
        step.batch, frac = filter_truncated(step.batch, step.completions)
        step.metrics["response/overlong_filtered_frac"] = frac


def build_stages(
    config: RLConfig,
    group: WorkerGroup,
    *,
    on_policy: bool,
    reference: Reference,
    teacher: bool,
    reward_model: bool,
    critic: bool,
) -> list[Stage]:
    """The run's stages, in the order they run."""
    temperature = config.sampling.temperature
    wanted: list[tuple[bool, Stage]] = [
        (not on_policy, OldLogProbs(group, temperature, config.algorithm.routing_replay)),
        (reference.enabled, ReferenceLogProbs(group, temperature, reference)),
        (teacher, TeacherLogProbs(group, temperature)),
        (reward_model, RewardModelScores(group, temperature)),
        (critic, Values(group, temperature)),
        (True, Advantages(config, on_policy)),
        (config.algorithm.dapo.overlong_filter, OverlongFilter()),
    ]
    return [stage for used, stage in wanted if used]
