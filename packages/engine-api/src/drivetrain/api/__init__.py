"""drivetrain's contracts: engines, rollouts, weight sync, batches, configs and plugins.

Standard library only, so that every drivetrain package, every third-party plugin and every
environment (a vLLM or SGLang one included) can depend on it without version fights.
"""

from drivetrain.api.batch import Batch, BatchMeta, Layout
from drivetrain.api.column_ops import ColumnOps, register_column_ops
from drivetrain.api.config import (
    EngineConfig,
    LoraConfig,
    MicroBatchConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RolloutConfig,
    WeightSyncConfig,
)
from drivetrain.api.engine import CheckpointInfo, Engine, NamedTensor, ParallelInfo, StepResult
from drivetrain.api.errors import (
    BatchError,
    ConfigError,
    DrivetrainError,
    EngineStateError,
    PluginError,
)
from drivetrain.api.loss import LossContext, LossFn, OutputSpec, merge_metrics
from drivetrain.api.plugin import KNOWN_CAPABILITIES, PluginSpec
from drivetrain.api.rollout import Completion, FinishReason, Prompt, Rollout, SamplingParams
from drivetrain.api.version import API_VERSION
from drivetrain.api.weight_sync import (
    SyncStats,
    TensorMeta,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)

__version__ = API_VERSION

__all__ = [
    "API_VERSION",
    "KNOWN_CAPABILITIES",
    "Batch",
    "BatchError",
    "BatchMeta",
    "CheckpointInfo",
    "ColumnOps",
    "Completion",
    "ConfigError",
    "DrivetrainError",
    "Engine",
    "EngineConfig",
    "EngineStateError",
    "FinishReason",
    "Layout",
    "LoraConfig",
    "LossContext",
    "LossFn",
    "MicroBatchConfig",
    "ModelConfig",
    "NamedTensor",
    "OffloadConfig",
    "OptimConfig",
    "OutputSpec",
    "ParallelInfo",
    "PluginError",
    "PluginSpec",
    "Prompt",
    "Rollout",
    "RolloutConfig",
    "SamplingParams",
    "StepResult",
    "SyncStats",
    "TensorMeta",
    "Topology",
    "TransportRole",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightTransport",
    "merge_metrics",
    "register_column_ops",
]
