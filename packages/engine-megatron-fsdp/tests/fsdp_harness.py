"""The conformance harness for the megatron_fsdp engine: engine-megatron's, building a
``MegatronFSDPEngine`` (``overrides`` may set Megatron-FSDP's knobs too)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from drivetrain.api import MicroBatchConfig
from drivetrain.engine.megatron_fsdp.config import MegatronFSDPConfig
from drivetrain.engine.megatron_fsdp.engine import MegatronFSDPEngine
from drivetrain.engine.megatron_fsdp.plugin import MEGATRON_FSDP
from megatron_harness import MegatronHarness


@dataclass
class FSDPHarness(MegatronHarness):
    capabilities: frozenset[str] = MEGATRON_FSDP.capabilities

    def config(self, micro_batch: MicroBatchConfig, **kit: Any) -> MegatronFSDPConfig:
        # the same hyper-parameters (and the kit's optim/offload/dropout)
        base = MegatronHarness(self.model_dir).config(micro_batch, **kit)
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        return MegatronFSDPConfig(**{**values, **self.overrides})

    def make_engine(self, micro_batch: MicroBatchConfig, **kit: Any) -> MegatronFSDPEngine:
        engine = MegatronFSDPEngine(self.config(micro_batch, **kit))
        engine.initialize()
        return engine
