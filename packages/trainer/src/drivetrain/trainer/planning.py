"""``drivetrain plan``'s side of the trainer: the work one rank of each training role does in a
job's step (from its config alone), each engine's planner asked for its memory, the rows of
the report. An engine without a planner is reported as unplanned, never guessed."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api import ConfigError, EngineConfig, registry
from drivetrain.api.plan import GiB, MemoryPlan, RankWork
from drivetrain.trainer.plan_target import Accelerator, PlanTarget


@dataclass(frozen=True)
class RolePlan:
    """A training role's plan, or why there is none (``plan`` None, ``reason`` set)."""

    role: str
    engine: str
    work: RankWork
    plan: MemoryPlan | None = None
    reason: str = ""

    def fits(self, target: PlanTarget) -> bool | None:
        if self.plan is None:
            return None
        return self.plan.peak_gib <= target.device.memory_gib

    def row(self, target: PlanTarget) -> dict[str, Any]:
        """The report's JSON for this role."""
        out: dict[str, Any] = {"role": self.role, "engine": self.engine, "tokens": self.work.tokens}
        if self.plan is None:
            return {**out, "planned": False, "reason": self.reason}
        return {
            **out,
            "planned": True,
            "world_size": self.plan.world_size,
            "peak_gib": round(self.plan.peak_gib, 2),
            "device_gib": target.device.memory_gib,
            "fits": self.fits(target),
            "gib": {k: round(v / GiB, 3) for k, v in self.plan.by_category.items()},
            "method": self.plan.method,
        }


def rank_work(engine: EngineConfig, sequences: int, length: int, ranks: int) -> RankWork:
    """What one of ``ranks`` data-parallel ranks computes in its largest micro-batch when a
    step trains ``sequences`` sequences of up to ``length`` tokens (the worst case: every
    sequence as long as allowed)."""
    per_rank = max(1, math.ceil(sequences / ranks))
    micro = engine.micro_batch
    packed = getattr(engine, "attention", "") == "varlen"
    if micro.max_tokens is not None:
        per_micro = max(1, min(per_rank, micro.max_tokens // length))
    else:
        per_micro = min(per_rank, micro.micro_batch_size or 1)
    count = math.ceil(per_rank / per_micro)
    if packed:
        return RankWork(documents=(length,) * per_micro, micro_batches=count)
    return RankWork(rows=per_micro, width=length, micro_batches=count)


def plan_role(
    role: str, engine: str, config: EngineConfig, work: RankWork, target: PlanTarget
) -> RolePlan:
    """Ask ``engine``'s planner; an engine without one, or a setting its planner does not
    model, is unplanned with the reason."""
    planner = registry.engines.load_planner(engine)
    if planner is None:
        return RolePlan(role, engine, work, reason=f"engine {engine!r} declares no planner")
    if not (Path(config.model.path) / "config.json").is_file():
        return RolePlan(role, engine, work, reason=f"no model config at {config.model.path}")
    try:
        return RolePlan(role, engine, work, plan=planner(config, target.gpus, work))
    except NotImplementedError as exc:
        return RolePlan(role, engine, work, reason=str(exc))


def remedies(role: str, config: EngineConfig) -> list[tuple[str, EngineConfig, int]]:
    """Settings that lower a role's peak, most often enough first: (override, config, the
    factor on the data-parallel ranks)."""
    found: list[tuple[str, EngineConfig, int]] = []
    model = config.model
    if not model.gradient_checkpointing:
        checkpointed = dataclasses.replace(model, gradient_checkpointing=True)
        found.append(
            (
                f"{role}.model.gradient_checkpointing=true",
                dataclasses.replace(config, model=checkpointed),
                1,
            )
        )
    budget = config.micro_batch.max_tokens
    if budget is not None and budget >= 2:
        smaller = dataclasses.replace(config.micro_batch, max_tokens=budget // 2)
        found.append(
            (
                f"{role}.micro_batch.max_tokens={budget // 2}",
                dataclasses.replace(config, micro_batch=smaller),
                1,
            )
        )
    found.append(("twice the GPUs", config, 2))
    return found


def refusal(planned: RolePlan, target: PlanTarget, fixes: list[tuple[str, RolePlan]]) -> str:
    """The one line that refuses a role that does not fit: by how much, the largest
    contributors, the settings that fit (with their peaks)."""
    plan = planned.plan
    assert plan is not None
    top = sorted(plan.by_category.items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)
    over = plan.peak_gib - target.device.memory_gib
    fits = "; ".join(f"{s} ({p.plan.peak_gib:.1f} GiB)" for s, p in fixes if p.plan) or "none found"
    return (
        f"{planned.role} needs {plan.peak_gib:.1f} GiB a rank on {target.gpus} x "
        f"{target.device.name} ({target.device.memory_gib:g} GiB): {over:.1f} GiB over; largest "
        f"(GiB): {largest}; fits with: {fits}"
    )


def plan_with_fixes(
    role: str, engine: str, config: EngineConfig, sequences: int, length: int, target: PlanTarget
) -> tuple[RolePlan, list[tuple[str, RolePlan]]]:
    """The role's plan on ``target``; when it does not fit, each remedy's plan that fits."""
    planned = plan_role(
        role, engine, config, rank_work(config, sequences, length, target.gpus), target
    )
    if planned.fits(target) is not False:
        return planned, []
    fixes = []
    for setting, changed, factor in remedies(role, config):
        wider = dataclasses.replace(target, gpus=target.gpus * factor, nodes=target.nodes * factor)
        work = rank_work(changed, sequences, length, wider.gpus)
        tried = plan_role(role, engine, changed, work, wider)
        if tried.fits(wider):
            fixes.append((setting, tried))
    return planned, fixes


@dataclass(frozen=True)
class PlanInputs:
    """What a job trains in a step, for planning: its training roles (name, engine, config),
    the step's sequences and their longest length."""

    roles: tuple[tuple[str, str, EngineConfig], ...]
    sequences: int
    length: int
    ranks: int = 1  # the job's data-parallel ranks (workers.num)


def rl_inputs(config: Any, engine: str) -> PlanInputs:
    """An RL job's actor: prompts x samples a step, prompt and new tokens at their limits."""
    sequences = config.run.prompts_per_step * config.sampling.n
    length = config.data.max_prompt_length + config.sampling.max_new_tokens
    return PlanInputs((("actor", engine, config.actor),), sequences, length, config.workers.num)


def sft_inputs(config: Any, engine: str) -> PlanInputs:
    """An SFT job's engine: a batch of sequences at ``data.max_length``."""
    return PlanInputs(
        (("engine", engine, config.engine),), config.run.batch_size, config.data.max_length
    )


def local_target(gpus: int) -> PlanTarget:
    """This machine's GPU as the target (its whole memory), ``gpus`` of them."""
    import torch

    props = torch.cuda.get_device_properties(0)
    device = Accelerator(props.name, props.total_memory / GiB, 0.0, 0.0)
    return PlanTarget(device, gpus=gpus)


def check_fits(inputs: PlanInputs, target: PlanTarget) -> None:
    """Refuse, in one line, a job a role of which will not fit ``target`` (roles whose engine
    cannot plan pass: nothing is guessed)."""
    for role, engine, config in inputs.roles:
        planned, fixes = plan_with_fixes(
            role, engine, config, inputs.sequences, inputs.length, target
        )
        if planned.fits(target) is False:
            raise ConfigError(
                f"this job will not fit: {refusal(planned, target, fixes)} (--no-plan-check "
                "starts it anyway)"
            )
