"""``drivetrain plan``'s side of the trainer: the work one rank of each training role does in a
job's step (from its config alone), each engine's planner asked for its memory, the rows of
the report. An engine without a planner is reported as unplanned, never guessed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api import EngineConfig, registry
from drivetrain.api.plan import GiB, MemoryPlan, PlanTarget, RankWork


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
        return RolePlan(role, engine, work, plan=planner(config, target, work))
    except NotImplementedError as exc:
        return RolePlan(role, engine, work, reason=str(exc))
