"""A step's optimizer updates: each role's loss over the batch, ``ppo_epochs`` passes in
mini-batches, sending the columns the loss reads (``loss.reads``) and nothing else of the
controller's."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from drivetrain.api import Batch
from drivetrain.trainer.rl.batch_ops import engine_view
from drivetrain.trainer.rl.config import RLConfig, updates_per_step
from drivetrain.trainer.rl.step_metrics import mean_stats
from drivetrain.trainer.rl.update_losses import ActorLoss, CriticLoss
from drivetrain.trainer.workers.engine_worker import StepStats
from drivetrain.trainer.workers.group import WorkerGroup
from drivetrain.trainer.workers.role_worker import ACTOR, CRITIC, RoleWorker


@dataclass(frozen=True)
class Update:
    """One role's update: its loss (which names the columns it reads) and its metrics."""

    role: str
    loss: Any  # ActorLoss, CriticLoss: picklable, with ``reads``

    @property
    def phase(self) -> str:
        return f"update_{self.role}"

    def run(self, group: WorkerGroup, batch: Batch, config: RLConfig, step: int) -> StepStats:
        """``ppo_epochs`` passes over the batch in mini-batches, one optimizer step each (the
        order shuffled per epoch, reproducibly, when there are several)."""
        alg = config.algorithm
        wanted = (*self.loss.reads, *self.loss.replays)
        view = engine_view(batch, *(c for c in wanted if c in batch))
        size = alg.mini_batch_size or len(view)
        stats: list[StepStats] = []
        for epoch in range(alg.ppo_epochs):
            order = list(range(len(view)))
            if size < len(view):
                random.Random(config.seed * 7919 + step * 131 + epoch).shuffle(order)
            for start in range(0, len(order), size):
                mini = view.select(order[start : start + size])
                loss = self.loss
                if not stats and isinstance(loss, ActorLoss):  # the step's first update
                    loss = dataclasses.replace(loss, first_update=True)
                stats.append(group.run_sharded(RoleWorker.train, mini, self.role, loss))
        return mean_stats(stats)

    def metrics(self, stats: StepStats) -> dict[str, float]:
        if self.role == ACTOR:  # the loss the run's progress and summary read
            return {
                "actor/grad_norm": stats.grad_norm,
                "actor/loss": stats.loss,
                "actor/lr": stats.lr,
                **stats.metrics,
            }
        return {**stats.metrics, f"{self.role}/grad_norm": stats.grad_norm}


def on_policy(config: RLConfig, reference_enabled: bool, teacher: bool) -> bool:
    """One update per batch, and nothing else needs the old log-probs before it: the update's
    own forward gives them (no separate pass). The KL in the reward and the teacher's reverse
    KL need them before the update."""
    alg = config.algorithm
    needs_old = (alg.kl.in_reward and reference_enabled) or teacher
    return alg.on_policy_shortcut and updates_per_step(config) == 1 and not needs_old


def build_updates(config: RLConfig, *, on_policy: bool, critic: bool) -> list[Update]:
    """The step's updates in the order they run: the critic's (its values are the old ones
    the advantages used), then the actor's."""
    alg, max_length = config.algorithm, config.sampling.max_new_tokens
    actor = ActorLoss(
        policy_loss=alg.policy_loss,
        clip=alg.clip,
        aggregation=alg.aggregation,
        max_length=max_length,
        entropy_coef=alg.entropy_coef,
        kl=alg.kl,  # its coefficient is 0 without a reference (config refuses otherwise)
        temperature=config.sampling.temperature,
        on_policy=on_policy,
        correction=alg.correction_name,
        correction_config=alg.correction,
        # old_policy on-policy: the update's own forward is the old policy; nothing to replay
        replay_routing=alg.routing_replay == "rollout"
        or (alg.routing_replay == "old_policy" and not on_policy),
        routing_metrics=config.rollout.return_routed_experts,
    )
    critic_update = Update(CRITIC, CriticLoss(alg.value_clip, alg.aggregation, max_length))
    return [*([critic_update] if critic else []), Update(ACTOR, actor)]
