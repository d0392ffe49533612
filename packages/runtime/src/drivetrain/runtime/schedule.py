"""The learning-rate schedule every engine follows, as a pure function of the step.

Engines wrap it in their framework's scheduler (e.g. ``torch.optim.lr_scheduler.LambdaLR``) so
that all engines agree on the LR at every step.
"""

from __future__ import annotations

import math

from drivetrain.api.config import OptimConfig
from drivetrain.api.errors import ConfigError


def warmup_steps(config: OptimConfig) -> int:
    if config.warmup_steps is not None:
        return config.warmup_steps
    return int(config.warmup_ratio * (config.total_steps or 0))


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """Factor on ``config.lr`` for optimizer step ``step`` (0-based).

    Linear warm-up from ``1/(warmup+1)`` to 1 over the warm-up steps, then constant, linear
    decay or cosine decay to ``min_lr_ratio`` at ``total_steps``.
    """
    if config.total_steps is None:
        if config.scheduler != "constant":
            raise ConfigError(f"optim.scheduler={config.scheduler!r} needs optim.total_steps")
        if config.warmup_ratio > 0 and config.warmup_steps is None:
            raise ConfigError("optim.warmup_ratio needs optim.total_steps (or set warmup_steps)")
    warmup = warmup_steps(config)
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.scheduler == "constant" or not config.total_steps:
        return 1.0
    span = max(1, config.total_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = config.min_lr_ratio
    if config.scheduler == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
