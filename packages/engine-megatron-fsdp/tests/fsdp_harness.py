"""The conformance harness for the megatron_fsdp engine: engine-megatron's, building a
``MegatronFSDPEngine`` (``overrides`` may set Megatron-FSDP's knobs too)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from drivetrain.api import MicroBatchConfig
from drivetrain.engine.megatron_fsdp.config import MegatronFSDPConfig
from drivetrain.engine.megatron_fsdp.engine import MegatronFSDPEngine
from megatron_harness import MegatronHarness


@dataclass
class FSDPHarness(MegatronHarness):
    def config(self, micro_batch: MicroBatchConfig) -> MegatronFSDPConfig:
        base = MegatronHarness(self.model_dir).config(micro_batch)  # the same hyper-parameters
        values = {f.name: getattr(base, f.name) for f in fields(base)}
        return MegatronFSDPConfig(**{**values, **self.overrides})

    def make_engine(self, micro_batch: MicroBatchConfig) -> MegatronFSDPEngine:
        engine = MegatronFSDPEngine(self.config(micro_batch))
        engine.initialize()
        return engine
