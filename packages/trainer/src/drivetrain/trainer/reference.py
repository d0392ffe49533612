"""Where a job's reference log-probs come from, decided once when the job is assembled.

The loops and workers ask this object (is there a reference, which role computes it, with the
actor's adapter off?) instead of comparing mode strings in each branch.
"""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.trainer.workers.role_worker import ACTOR, REFERENCE

#: What ``reference.mode`` resolves to: a frozen engine, the actor with its LoRA adapter off,
#: log-probs that came with the data (DPO), or no reference at all.
MODES = ("engine", "adapter", "precomputed", "none")


@dataclass(frozen=True)
class Reference:
    mode: str = "none"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"reference mode must be one of {', '.join(MODES)}: {self.mode!r}")

    @property
    def enabled(self) -> bool:
        """Whether the job has reference log-probs at all."""
        return self.mode != "none"

    @property
    def computed(self) -> bool:
        """Whether a worker computes them (not precomputed in the data, not absent)."""
        return self.mode in ("engine", "adapter")

    @property
    def role(self) -> str:
        """The worker role whose engine computes them."""
        if not self.computed:
            raise ValueError(f"a {self.mode!r} reference is not computed by any role")
        return REFERENCE if self.mode == "engine" else ACTOR

    @property
    def adapter_off(self) -> bool:
        """Whether the computing engine runs with its LoRA adapter disabled."""
        return self.mode == "adapter"

    @property
    def needs_engine(self) -> bool:
        """Whether the job builds a frozen reference engine (a role of its own)."""
        return self.mode == "engine"
