"""The conformance harness of the fake engine (and a template for real engines' harnesses)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.config import MicroBatchConfig, OffloadConfig, OptimConfig
from drivetrain.api.engine import Engine
from drivetrain.testing import fake_model
from drivetrain.testing.fake_engine import FakeEngine, FakeEngineConfig
from drivetrain.testing.plugins import FAKE_ENGINE


@dataclass
class FakeHarness:
    engine_class: type[FakeEngine] = FakeEngine
    vocab_size: int = 12
    atol: float = 1e-9
    rtol: float = 1e-9
    packed: bool = True
    capabilities: frozenset[str] = FAKE_ENGINE.capabilities
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-2, clip_grad=None))

    def make_engine(
        self,
        micro_batch: MicroBatchConfig,
        *,
        optim: OptimConfig | None = None,
        offload: OffloadConfig | None = None,
        dropout: float = 0.0,
    ) -> Engine:
        config = FakeEngineConfig(
            vocab_size=self.vocab_size,
            micro_batch=micro_batch,
            optim=optim or self.optim,
            offload=offload or OffloadConfig(),
            dropout=dropout,
        )
        engine = self.engine_class(config)
        engine.initialize()
        return engine

    def make_batch(
        self, sequences: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]]
    ) -> Batch:
        width = max(len(s) for s in sequences)
        return Batch.from_columns(
            {
                "input_ids": [list(s) + [0] * (width - len(s)) for s in sequences],
                "loss_mask": [
                    [float(m) for m in row] + [0.0] * (width - len(row)) for row in loss_mask
                ],
            },
            seq_lens=[len(s) for s in sequences],
        )

    def to_list(self, value: Any) -> Any:
        return value

    def dtype_of(self, value: Any) -> str:
        # the fake's columns are lists of Python numbers, standing for the contract's dtypes;
        # a typed container (a test's) says its own
        return getattr(value, "dtype", "float32")

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]  # the fake engine is single-process

    def reference_weights(self) -> Mapping[str, Any]:
        return fake_model.init_weights(self.vocab_size, seed=0)
