"""Planning a step before it runs: the work one rank does, and what an engine's planner answers
(its busiest rank's memory by category, from the engine's own code on fake tensors).

An engine takes part by naming a planner in its :class:`~drivetrain.api.plugin.PluginSpec`
(``planner="module:function"``, called ``function(config, world_size, work) -> MemoryPlan``);
``drivetrain plan`` reports an engine without one as unplanned, never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 2**30


@dataclass(frozen=True)
class RankWork:
    """One rank's largest micro-batch: documents of these lengths (one packed row), or
    ``rows`` padded rows of ``width`` tokens; ``micro_batches`` per optimizer step.
    ``train`` False: a frozen role's forward (a reference, a teacher): no gradients, no
    optimizer."""

    documents: tuple[int, ...] = ()
    rows: int = 0
    width: int = 0
    micro_batches: int = 1
    train: bool = True

    @property
    def tokens(self) -> int:
        return sum(self.documents) if self.documents else self.rows * self.width


@dataclass(frozen=True)
class MemoryPlan:
    """The busiest rank's bytes by category (``parameters``, ``gradients``, ``optimizer``,
    ``activations``...) and the step's peak (not their sum: they peak at different times)."""

    engine: str
    world_size: int
    peak_bytes: int
    by_category: dict[str, int] = field(default_factory=dict)
    method: str = ""  # how it was computed, in words

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GiB
