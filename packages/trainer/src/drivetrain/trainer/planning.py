"""``drivetrain plan``'s side of the trainer: the work one rank of each training role does in a
job's step (from its config alone), each engine's planner asked for its memory, the rows of
the report. An engine without a planner is reported as unplanned, never guessed."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api import ConfigError, EngineConfig, OffloadConfig, registry
from drivetrain.api.plan import GiB, MemoryPlan, RankWork
from drivetrain.trainer.plan_rank import Phase, RolloutShare, busiest, phases, rollout_share
from drivetrain.trainer.plan_target import Accelerator, PlanTarget


@dataclass(frozen=True)
class RolePlan:
    """A training role's plan, or why there is none (``plan`` None, ``reason`` set)."""

    role: str
    engine: str
    work: RankWork
    plan: MemoryPlan | None = None
    reason: str = ""

    def row(self) -> dict[str, Any]:
        """The report's JSON for this role."""
        out: dict[str, Any] = {
            "role": self.role, "engine": self.engine, "tokens": self.work.tokens,
            "trains": self.work.train,
        }  # fmt: skip
        if self.plan is None:
            return {**out, "planned": False, "reason": self.reason}
        return {
            **out,
            "planned": True,
            "world_size": self.plan.world_size,
            "peak_gib": round(self.plan.peak_gib, 2),
            "gib": {k: round(v / GiB, 3) for k, v in self.plan.by_category.items()},
            "method": self.plan.method,
        }


def rank_work(
    engine: EngineConfig, sequences: int, length: int, ranks: int, *, train: bool = True
) -> RankWork:
    """What one of ``ranks`` data-parallel ranks computes in its largest micro-batch when a
    step trains (or, ``train`` False, scores) ``sequences`` sequences of up to ``length``
    tokens (the worst case: every sequence as long as allowed)."""
    per_rank = max(1, math.ceil(sequences / ranks))
    micro = engine.micro_batch
    packed = getattr(engine, "attention", "") == "varlen"
    if micro.max_tokens is not None:
        per_micro = max(1, min(per_rank, micro.max_tokens // length))
    else:
        per_micro = min(per_rank, micro.micro_batch_size or 1)
    count = math.ceil(per_rank / per_micro)
    if packed:
        return RankWork(documents=(length,) * per_micro, micro_batches=count, train=train)
    return RankWork(rows=per_micro, width=length, micro_batches=count, train=train)


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
    # offload moves states between phases, not within a role's own step: one plan serves both
    key = (engine, repr(dataclasses.replace(config, offload=OffloadConfig())), target.gpus, work)
    try:
        if key not in _PLANNED:
            _PLANNED[key] = planner(config, target.gpus, work)
    except NotImplementedError as exc:
        return RolePlan(role, engine, work, reason=str(exc))
    return RolePlan(role, engine, work, plan=_PLANNED[key])


#: plans made in this process (a refusal's remedies and a table re-plan the same role often)
_PLANNED: dict[tuple[str, str, int, RankWork], MemoryPlan] = {}


@dataclass(frozen=True)
class JobPlan:
    """Every role of a job on one rank of ``target``, the colocated rollout, the phases of a
    step and the busiest one; ``unplanned``: roles (or the rollout) nothing could be said of."""

    target: PlanTarget
    roles: tuple[RolePlan, ...]
    phases: tuple[Phase, ...]
    unplanned: tuple[str, ...] = ()

    @property
    def peak(self) -> Phase | None:
        return busiest(list(self.phases)) if self.phases else None

    def fits(self) -> bool | None:
        """None when a role could not be planned and what was planned fits (nothing is
        guessed); False as soon as what was planned does not fit."""
        peak = self.peak
        if peak is not None and peak.bytes > self.target.device.memory_gib * GiB:
            return False
        return None if self.unplanned or peak is None else True


def plan_job(inputs: PlanInputs, target: PlanTarget) -> JobPlan:
    """Each role's plan on ``target`` and the phases of a step on one rank."""
    planned = [
        plan_role(
            r.role,
            r.engine,
            r.config,
            rank_work(r.config, inputs.sequences, inputs.length, target.gpus, train=r.train),
            target,
        )
        for r in inputs.roles
    ]
    unplanned = [f"{p.role}: {p.reason}" for p in planned if p.plan is None]
    if inputs.colocated and inputs.rollout is None:
        unplanned.append("rollout: no model config to size it from")
    by_role = {r.role: r for r in inputs.roles}
    known = [
        (p.role, by_role[p.role].config, p.plan, by_role[p.role].train)
        for p in planned
        if p.plan is not None
    ]
    found = phases(known, inputs.rollout, target.device.memory_gib * GiB) if known else []
    return JobPlan(target, tuple(planned), tuple(found), tuple(unplanned))


def remedies(inputs: PlanInputs, busy: str) -> list[tuple[str, PlanInputs, int]]:
    """Settings that lower the busiest phase (``busy``: the role that runs in it, or
    ``rollout``), most often enough first: (override, the changed inputs, the factor on the
    GPUs)."""
    found: list[tuple[str, PlanInputs, int]] = []

    def changed(role: str, setting: str, config: EngineConfig) -> None:
        roles = tuple(
            dataclasses.replace(r, config=config) if r.role == role else r for r in inputs.roles
        )
        found.append((setting, dataclasses.replace(inputs, roles=roles), 1))

    own = next((r for r in inputs.roles if r.role == busy), None)
    if own is not None and own.train and not own.config.model.gradient_checkpointing:
        model = dataclasses.replace(own.config.model, gradient_checkpointing=True)
        setting = f"{busy}.model.gradient_checkpointing=true"
        changed(busy, setting, dataclasses.replace(own.config, model=model))
    budget = own.config.micro_batch.max_tokens if own is not None else None
    if own is not None and budget is not None and budget >= 2 * inputs.length:
        smaller = dataclasses.replace(own.config.micro_batch, max_tokens=budget // 2)
        setting = f"{busy}.micro_batch.max_tokens={budget // 2}"
        changed(busy, setting, dataclasses.replace(own.config, micro_batch=smaller))
    for other in inputs.roles:  # the others' states off the device while this one runs
        if other.role != busy and other.train and not other.config.offload.optimizer:
            offload = dataclasses.replace(other.config.offload, params=True, optimizer=True)
            setting = f"{other.role}.offload.params=true {other.role}.offload.optimizer=true"
            changed(other.role, setting, dataclasses.replace(other.config, offload=offload))
    found.append(("twice the GPUs", inputs, 2))
    return found


def refusal(plan: JobPlan, fixes: list[tuple[str, JobPlan]]) -> str:
    """The one line that refuses a job that does not fit: the busiest phase, by how much, its
    largest contributors, the settings that fit (with their peaks)."""
    peak, target = plan.peak, plan.target
    assert peak is not None
    top = sorted(_contributors(plan, peak).items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{k} {v / GiB:.1f}" for k, v in top)
    over = peak.bytes / GiB - target.device.memory_gib
    fits = "; ".join(f"{s} ({p.peak.bytes / GiB:.1f} GiB)" for s, p in fixes if p.peak)
    return (
        f"{peak.name} needs {peak.bytes / GiB:.1f} GiB a rank on {target.gpus} x "
        f"{target.device.name} ({target.device.memory_gib:g} GiB): {over:.1f} GiB over; "
        f"largest (GiB): {largest}; fits with: {fits or 'none found'}"
    )


def _contributors(plan: JobPlan, peak: Phase) -> dict[str, int]:
    """The busiest phase's bytes by what holds them: the busy role's own categories (its
    activations, optimizer...), the others as one each."""
    out: dict[str, int] = {}
    for part, value in peak.parts.items():
        role = part.removesuffix(" peak")
        own = next((r.plan for r in plan.roles if r.role == role and r.plan), None)
        if part.endswith(" peak") and own is not None:
            for category, v in own.by_category.items():
                out[category if len(plan.roles) == 1 else f"{role} {category}"] = v
        else:
            out[part] = value
    return out


def plan_with_fixes(
    inputs: PlanInputs, target: PlanTarget
) -> tuple[JobPlan, list[tuple[str, JobPlan]]]:
    """The job's plan on ``target``; when it does not fit, each remedy's plan that fits."""
    planned = plan_job(inputs, target)
    if planned.fits() is not False:
        return planned, []
    assert planned.peak is not None
    fixes = []
    for setting, changed, factor in remedies(inputs, planned.peak.busy):
        wider = dataclasses.replace(target, gpus=target.gpus * factor, nodes=target.nodes * factor)
        tried = plan_job(changed, wider)
        if tried.fits() is not False and tried.peak is not None:
            fixes.append((setting, tried))
    return planned, fixes


@dataclass(frozen=True)
class RoleInput:
    """A role a job runs on its training ranks: ``train`` False for a frozen one (reference,
    teacher, reward model), which only scores."""

    role: str
    engine: str
    config: EngineConfig
    train: bool = True


@dataclass(frozen=True)
class PlanInputs:
    """What a job runs in a step, for planning: its roles on the training ranks, the step's
    sequences and their longest length (``prompt`` + ``new`` for RL), the colocated rollout
    sharing the training ranks' devices (None: none, or on devices of its own)."""

    roles: tuple[RoleInput, ...]
    sequences: int
    length: int
    ranks: int = 1  # the job's data-parallel ranks (workers.num)
    rollout: RolloutShare | None = None
    colocated: bool = False  # a rollout shares the ranks' devices (``rollout`` its share)
    prompt: int = 0
    new: int = 0
    epochs: int = 1
    old_log_probs: bool = False  # a forward of the actor before its updates (off-policy)


def rl_inputs(job: Any) -> PlanInputs:
    """An RL job (:class:`~drivetrain.trainer.rl.job.RLJob`): each role of its training ranks
    (actor, critic; reference, teacher, reward model frozen), prompts x samples a step, prompt
    and new tokens at their limits, and its rollout when colocated."""
    from drivetrain.trainer.rl.config import updates_per_step
    from drivetrain.trainer.rl.job import role_specs
    from drivetrain.trainer.rl.placement import resolve_mode
    from drivetrain.trainer.rl.updates import on_policy
    from drivetrain.trainer.workers.role_worker import ACTOR, CRITIC, REFERENCE, TEACHER

    config = job.config
    specs, _ = role_specs(job, updates_per_step(config))
    roles = tuple(
        RoleInput(name, spec.engine, spec.config, train=name in (ACTOR, CRITIC))
        for name, spec in specs.items()
    )
    prompt, new = config.data.max_prompt_length, config.sampling.max_new_tokens
    shared = resolve_mode(config.placement, config.workers) in ("inprocess", "colocated")
    return PlanInputs(
        roles,
        sequences=config.run.prompts_per_step * config.sampling.n,
        length=prompt + new,
        ranks=config.workers.num,
        rollout=rollout_share(job.rollout, config.rollout, config.actor) if shared else None,
        colocated=shared,
        prompt=prompt,
        new=new,
        epochs=config.algorithm.ppo_epochs,
        old_log_probs=not on_policy(config, REFERENCE in specs, TEACHER in specs),
    )


def sft_inputs(config: Any, engine: str) -> PlanInputs:
    """An SFT job's engine: a batch of sequences at ``data.max_length``."""
    return PlanInputs(
        (RoleInput("engine", engine, config.engine),), config.run.batch_size, config.data.max_length
    )


def local_target(gpus: int) -> PlanTarget:
    """This machine's GPU as the target (its whole memory), ``gpus`` of them."""
    import torch

    props = torch.cuda.get_device_properties(0)
    device = Accelerator(props.name, props.total_memory / GiB, 0.0, 0.0)
    return PlanTarget(device, gpus=gpus)


def check_fits(inputs: PlanInputs, target: PlanTarget) -> None:
    """Refuse, in one line, a job whose busiest phase will not fit ``target`` (what cannot be
    planned passes: nothing is guessed)."""
    planned, fixes = plan_with_fixes(inputs, target)
    if planned.fits() is False:
        raise ConfigError(
            f"this job will not fit: {refusal(planned, fixes)} (--no-plan-check starts it anyway)"
        )
