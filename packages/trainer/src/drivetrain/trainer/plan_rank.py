"""One training rank's device over a step: the roles it holds and the colocated rollout.

A rank holds every role of the job (``RoleWorker``: actor, critic, reference, teacher, reward
model) and, colocated, a rollout replica. They take turns: the rollout generates (every role's
states stay where they are), then each role scores or trains in its turn. A phase peaks at the
busy one's own peak plus what the others hold meanwhile (their parameters, optimizer state and
buffers, unless offloaded between modes); the rank's peak is its busiest phase. A colocated
rollout on an accelerator must declare ``sleep`` (the job refuses it otherwise): it gives its
memory back while the roles run, and takes its share while it generates
(``RolloutConfig.device_share``: vLLM's ``gpu_memory_utilization`` of the device, SGLang's
``mem_fraction_static``; else its weights and a full batch's KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivetrain.api import EngineConfig, registry
from drivetrain.api.plan import MemoryPlan
from drivetrain.trainer.plan_time import ModelShape

#: the dtypes a rollout may hold its weights in, and their bytes
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RolloutShare:
    """A colocated rollout's device memory while it generates: a ``fraction`` of the device,
    or ``fixed_bytes`` (its weights and KV cache); ``sleeps``: it frees it in between."""

    name: str
    fraction: float = 0.0
    fixed_bytes: int = 0
    sleeps: bool = True

    def bytes_on(self, device_bytes: float) -> int:
        return int(self.fraction * device_bytes) if self.fraction else self.fixed_bytes


def rollout_share(name: str, rollout: Any, actor: EngineConfig) -> RolloutShare | None:
    """What the rollout ``name`` configured by ``rollout`` takes; None when its model's shape
    cannot be read (the plan then says the rollout is unplanned)."""
    sleeps = "sleep" in registry.rollouts.spec(name).capabilities
    fraction, batch = rollout.device_share()
    if fraction:
        return RolloutShare(name, fraction=fraction, sleeps=sleeps)
    path = Path(getattr(rollout, "model_path", "") or actor.model.path)
    if not (path / "config.json").is_file():
        return None
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(path)
    shape = ModelShape.of(hf)
    dtype = DTYPE_BYTES[rollout.dtype]
    embedding = 0 if getattr(hf, "tie_word_embeddings", False) else shape.vocab * shape.hidden
    weights = (shape.matmul_params + embedding) * dtype
    kv = batch * rollout.max_model_len * shape.kv_bytes_per_token(dtype)
    return RolloutShare(name, fixed_bytes=weights + kv, sleeps=sleeps)


def resident(plan: MemoryPlan, config: EngineConfig) -> int:
    """What a role holds on the device while another runs (its offloaded states excepted)."""
    held = dict(plan.by_category)
    if config.offload.params:
        held.pop("parameters", None)
    if config.offload.optimizer:
        held.pop("optimizer", None)
    return sum(v for k, v in held.items() if k in ("parameters", "optimizer", "buffers"))


@dataclass(frozen=True)
class Phase:
    """A part of the step on one rank: what is busy (a role, or ``rollout``), and the bytes it
    and the rest hold."""

    name: str
    busy: str
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(self.parts.values())


def phases(
    roles: list[tuple[str, EngineConfig, MemoryPlan, bool]],
    rollout: RolloutShare | None,
    device_bytes: float,
) -> list[Phase]:
    """The phases of a step on one rank: ``roles`` as (name, config, plan, trains)."""
    held = {name: resident(plan, config) for name, config, plan, _ in roles}
    awake = 0 if rollout is None or rollout.sleeps else rollout.bytes_on(device_bytes)
    found = []
    if rollout is not None:
        generating = {f"{n} (held)": b for n, b in held.items()}
        generating[f"rollout {rollout.name}"] = rollout.bytes_on(device_bytes)
        found.append(Phase("rollout generates", "rollout", generating))
    for name, _, plan, trains in roles:
        parts = {f"{name} peak": plan.peak_bytes}
        parts.update({f"{n} (held)": b for n, b in held.items() if n != name})
        if awake:
            parts[f"rollout {rollout.name} (awake: no sleep)"] = awake  # type: ignore[union-attr]
        found.append(Phase(f"{name} {'trains' if trains else 'scores'}", name, parts))
    return found


def busiest(found: list[Phase]) -> Phase:
    return max(found, key=lambda phase: phase.bytes)
