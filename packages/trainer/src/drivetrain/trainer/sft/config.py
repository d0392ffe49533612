"""The SFT job's configuration: data, run length and checkpoints (logging and workers are
every job's: :mod:`drivetrain.trainer.job_config`).

The engine's own config class (``FSDPConfig`` for ``--engine fsdp2``, ...) is plugged in under
``engine`` at load time by :func:`sft_config_type`, so YAML files and dotted overrides reach
the engine's knobs (``engine.optim.lr=1e-4``) and unknown keys are reported at every level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from drivetrain.api.config import EngineConfig, MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.job_config import (
    LoggingConfig,
    RunConfig,
    WorkersConfig,
    with_engine_config,
)

TRUNCATION = ("error", "left", "right")


@dataclass(frozen=True)
class DataConfig:
    """Local data files. Empty ``train_path`` (with an empty ``engine.model.path``) selects the
    built-in synthetic addition task and its locally built model."""

    train_path: str = ""
    val_path: str = ""
    tokenizer_path: str = ""  # empty: the model's directory
    val_ratio: float = 0.0  # held out of train_path when val_path is empty
    prompt_key: str = "prompt"
    response_key: str = "response"
    messages_key: str = "messages"
    max_length: int = 1024
    truncation: str = "error"  # error | left (keep the end) | right (keep the start)
    packing: bool = True  # packed (padding-free) batches, to an engine declaring `packed`
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATION:
            raise ConfigError(
                f"data.truncation={self.truncation!r} is not one of {', '.join(TRUNCATION)}"
            )
        if not 0.0 <= self.val_ratio < 1.0:
            raise ConfigError(f"data.val_ratio={self.val_ratio} must be in [0, 1)")
        if self.max_length < 2:
            raise ConfigError(f"data.max_length={self.max_length} must be >= 2")


def _default_engine() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(),
        optim=OptimConfig(lr=1e-4, weight_decay=0.0),
        micro_batch=MicroBatchConfig(max_tokens=8192),
    )


@dataclass(frozen=True)
class SFTConfig:
    engine: EngineConfig = field(default_factory=_default_engine)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    seed: int = 0  # data order, validation split and the engine's seed


def sft_config_type(engine_config: type[EngineConfig]) -> type[SFTConfig]:
    """``SFTConfig`` whose ``engine`` field has the chosen engine's config class."""
    return with_engine_config(SFTConfig, engine_config, _default_engine)
