"""The preference job's configuration (``drivetrain dpo``).

Like SFT's, the engine's own config class is plugged in under ``engine`` at load time
(:func:`dpo_config_type`), so every engine knob is reachable with dotted overrides.
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

LOSSES = ("sigmoid", "ipo", "simpo")
#: losses that compare with a reference model, and the one that does not
NEEDS_REFERENCE = ("sigmoid", "ipo")
REFERENCE_MODES = ("auto", "engine", "adapter", "precomputed", "none")


@dataclass(frozen=True)
class PreferenceDataConfig:
    """Local JSONL/JSON/Parquet rows of ``prompt`` (text or chat messages), ``chosen`` and
    ``rejected`` (text or assistant messages); with reference.mode=precomputed also
    ``ref_chosen_logps`` and ``ref_rejected_logps`` (TRL's column names)."""

    train_path: str = ""
    val_path: str = ""  # held-out pairs: preference accuracy before and after
    tokenizer_path: str = ""  # empty: the model's directory
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    max_length: int = 1024  # tokens of prompt + answer; longer pairs are an error
    packing: bool = True  # pairs in one padding-free row, to an engine declaring `packed`
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.max_length < 2:
            raise ConfigError(f"data.max_length={self.max_length} must be >= 2")


@dataclass(frozen=True)
class PreferenceLossConfig:
    """``sigmoid``: DPO (Rafailov et al. 2023); ``ipo``: IPO (Azar et al. 2023, on
    length-averaged log-ratios, as TRL); ``simpo``: SimPO (Meng et al. 2024, reference-free,
    length-averaged, target margin ``simpo_gamma``)."""

    loss: str = "sigmoid"
    beta: float = 0.1
    simpo_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"algorithm.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.beta <= 0:
            raise ConfigError(f"algorithm.beta={self.beta} must be > 0")


@dataclass(frozen=True)
class PreferenceReferenceConfig:
    """``auto``: none for simpo; the actor with its LoRA adapter disabled when the actor trains
    LoRA; else a frozen engine (the actor's backend and config) on ``model_path`` (empty: the
    actor's starting model). ``precomputed``: the data's ``ref_*_logps`` columns."""

    mode: str = "auto"
    model_path: str = ""

    def __post_init__(self) -> None:
        if self.mode not in REFERENCE_MODES:
            raise ConfigError(
                f"reference.mode={self.mode!r} is not one of {', '.join(REFERENCE_MODES)}"
            )


def _default_engine() -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(),
        optim=OptimConfig(lr=5e-7, weight_decay=0.0),
        micro_batch=MicroBatchConfig(max_tokens=8192),
    )


@dataclass(frozen=True)
class DPOConfig:
    engine: EngineConfig = field(default_factory=_default_engine)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    algorithm: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    reference: PreferenceReferenceConfig = field(default_factory=PreferenceReferenceConfig)
    #: batch_size counts pairs per optimizer step; eval_batch_size pairs per held-out chunk
    run: RunConfig = field(default_factory=lambda: RunConfig(output_dir="runs/dpo"))
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    workers: WorkersConfig = field(default_factory=WorkersConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        loss, mode = self.algorithm.loss, self.reference_mode
        if loss in NEEDS_REFERENCE and mode == "none":
            raise ConfigError(
                f"algorithm.loss={loss} compares with a reference: reference.mode=none"
            )
        if loss not in NEEDS_REFERENCE and mode != "none":
            raise ConfigError(f"algorithm.loss={loss} is reference-free, but reference.mode={mode}")
        if mode == "adapter" and not self.engine.model.lora.enabled:
            raise ConfigError(
                "reference.mode=adapter needs a LoRA actor (engine.model.lora.rank > 0)"
            )
        if self.reference.model_path and mode != "engine":
            raise ConfigError(f"reference.model_path is for reference.mode=engine, not {mode}")

    @property
    def reference_mode(self) -> str:
        """``engine``, ``adapter``, ``precomputed`` or ``none`` (``auto`` resolved)."""
        if self.reference.mode != "auto":
            return self.reference.mode
        if self.algorithm.loss not in NEEDS_REFERENCE:
            return "none"
        return "adapter" if self.engine.model.lora.enabled else "engine"


def dpo_config_type(engine_config: type[EngineConfig]) -> type[DPOConfig]:
    """``DPOConfig`` whose ``engine`` field has the chosen engine's config class."""
    return with_engine_config(DPOConfig, engine_config, _default_engine)
