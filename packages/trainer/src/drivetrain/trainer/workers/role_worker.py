"""One rank of a job with roles (RL, DPO): the engines of every training-side role on this
rank, and the operations the controller runs on them by name.

Roles share the rank's process and torch.distributed world (verl's colocated roles): the actor
(trained), the reference (frozen), the critic (trained, value head), the reward model
(frozen, value head) and the distillation teacher (frozen). Each may use another engine
backend. The RL job's ranks also send the actor's weights to the rollouts
(:class:`drivetrain.trainer.rl.sync_worker.SyncingWorker`); DPO's do not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.api import Batch, EngineConfig, LossFn, OutputSpec, ParallelInfo
from drivetrain.trainer.named_registry import import_plugins
from drivetrain.trainer.workers.engine_worker import EngineWorker, StepStats

ACTOR, REFERENCE, CRITIC, REWARD_MODEL = "actor", "reference", "critic", "reward_model"
TEACHER = "teacher"  # on-policy distillation: a frozen model scoring the student's tokens


@dataclass(frozen=True)
class RoleSpec:
    engine: str
    config: EngineConfig


class RoleWorker:
    def __init__(self, roles: Mapping[str, RoleSpec], plugins: tuple[str, ...] = ()) -> None:
        import_plugins(plugins)  # user losses registered by name before any step runs
        if ACTOR not in roles:
            raise ValueError("an RL worker needs the actor role")
        self.roles = {name: EngineWorker(s.engine, s.config) for name, s in roles.items()}

    def initialize(self) -> ParallelInfo:
        infos = {name: worker.initialize() for name, worker in self.roles.items()}
        actor = infos[ACTOR]
        for name, info in infos.items():
            if info.dp_size != actor.dp_size or info.dp_rank != actor.dp_rank:
                raise ValueError(
                    f"role {name} has data-parallel layout {info.dp_rank}/{info.dp_size}, the "
                    f"actor {actor.dp_rank}/{actor.dp_size}: roles on one pool must agree"
                )
        return actor

    def shard(self, batch: Batch) -> Batch:
        return self.roles[ACTOR].shard(batch)

    @property
    def rank(self) -> int:
        return self.roles[ACTOR].engine.parallel.rank

    # ---- compute ------------------------------------------------------------------------
    def infer(
        self, shard: Batch, role: str, spec: OutputSpec, adapter_off: bool = False
    ) -> dict[str, Any] | None:
        """Per-token outputs of ``role`` on this shard (CPU tensors; None off output ranks).
        ``adapter_off``: the actor with its LoRA adapter disabled (the reference)."""
        engine = self.roles[role].engine
        disabled = engine.disable_adapter() if adapter_off else contextlib.nullcontext()
        with engine.eval_mode(), disabled:
            out = engine.infer(shard, spec)
        if out is None:
            return None
        return {name: out[name].detach().cpu() for name in spec.names}

    def train(self, shard: Batch, role: str, loss: LossFn) -> StepStats:
        return self.roles[role].train_step(shard, loss)

    # ---- checkpoints and export ---------------------------------------------------------
    @property
    def trained(self) -> tuple[str, ...]:
        """The roles a checkpoint holds: the actor, and the critic where there is one (the
        reference, reward model and teacher are frozen)."""
        return tuple(role for role in (ACTOR, CRITIC) if role in self.roles)

    def save_checkpoint(self, path: str, step: int) -> None:
        for role in self.trained:
            self.roles[role].save_checkpoint(f"{path}/{role}", step)

    def load_checkpoint(self, path: str) -> int:
        steps = {self.roles[role].load_checkpoint(f"{path}/{role}") for role in self.trained}
        if len(steps) != 1:
            raise ValueError(f"the roles' checkpoints under {path} disagree on the step: {steps}")
        return steps.pop()

    def export_hf(self, path: str) -> None:
        self.roles[ACTOR].export_hf(path)

    def close(self) -> None:
        for worker in self.roles.values():
            worker.close()
