"""Planning a job before it starts: the target cluster, the work one rank does, and what an
engine's planner answers (its per-rank memory by category, from the engine's own code run on
fake tensors over a fake process group of the target's world size).

An engine takes part by naming a planner in its :class:`~drivetrain.api.plugin.PluginSpec`
(``planner="module:function"``, called as ``function(config, target, work) -> MemoryPlan``);
an engine without one is reported as unplanned, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drivetrain.api.errors import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class Accelerator:
    """A device model: its memory, dense bf16 peak and memory bandwidth (the vendors' sheets)."""

    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_tb_per_s: float


ACCELERATORS = {
    a.name: a
    for a in (
        Accelerator("h100-80gb", 79.6, 989.0, 3.35),
        Accelerator("h200-141gb", 139.8, 989.0, 4.8),
        Accelerator("a100-80gb", 79.3, 312.0, 2.04),
        Accelerator("a100-40gb", 39.4, 312.0, 1.56),
        Accelerator("b200-180gb", 178.4, 2250.0, 8.0),
    )
}


def accelerator(name: str) -> Accelerator:
    """The device called ``name``; one line naming the known ones otherwise."""
    if name not in ACCELERATORS:
        raise ConfigError(f"--gpu {name!r} is not one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]


@dataclass(frozen=True)
class PlanTarget:
    """Where the job will run: ``gpus`` devices in all over ``nodes`` nodes."""

    device: Accelerator
    gpus: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.nodes < 1 or self.gpus % self.nodes:
            raise ConfigError(f"--gpus {self.gpus} must be >= 1 and a multiple of --nodes")


@dataclass(frozen=True)
class RankWork:
    """What one rank computes in its largest micro-batch: the documents' lengths (one packed
    row) or ``rows`` padded rows of ``width`` tokens; and micro-batches per optimizer step."""

    documents: tuple[int, ...] = ()
    rows: int = 0
    width: int = 0
    micro_batches: int = 1

    @property
    def tokens(self) -> int:
        return sum(self.documents) if self.documents else self.rows * self.width


@dataclass(frozen=True)
class MemoryPlan:
    """A role's memory on its busiest rank, in bytes by category (``parameters``,
    ``gradients``, ``optimizer``, ``activations``, ``temporary``...), and the peak the step
    reaches (not the sum: categories peak at different moments)."""

    engine: str
    world_size: int
    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    method: str = ""  # how it was computed, in words
    notes: tuple[str, ...] = ()

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB
