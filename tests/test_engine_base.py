"""The torch engines share one base for placement, output checks and device resolution, and
the controller's data split is the only one (``ParallelInfo.shard_of``)."""

import re
from pathlib import Path

import pytest

from drivetrain.api import EngineStateError, OutputSpec
from drivetrain.engine.fsdp.engine import FSDPEngine
from drivetrain.engine.megatron.engine import MegatronEngine
from drivetrain.engine.megatron_fsdp.engine import MegatronFSDPEngine
from drivetrain.engine_core.base import TorchEngine

ROOT = Path(__file__).resolve().parents[1]


def test_resolve_device_is_defined_once_in_product_code():
    found = [
        path.relative_to(ROOT).as_posix()
        for path in ROOT.glob("packages/*/src/**/*.py")
        if re.search(r"^\s*def _?resolve_device\b", path.read_text(), re.MULTILINE)
    ]
    assert found == ["packages/runtime/src/drivetrain/runtime/devices.py"]


@pytest.mark.parametrize("engine", [FSDPEngine, MegatronEngine, MegatronFSDPEngine])
def test_engines_take_placement_and_output_checks_from_the_base(engine):
    assert issubclass(engine, TorchEngine)
    shared = {"_place", "to", "_check_outputs", "_training_outputs"}
    overridden = {name for cls in engine.__mro__[: engine.__mro__.index(TorchEngine)]
                  for name in shared if name in vars(cls)}  # fmt: skip
    assert overridden == set()


class _Probe(TorchEngine):
    """The base's mechanics alone: records each move instead of moving tensors."""

    def __init__(self, *, value_head=False, params=False, optimizer=False):
        from drivetrain.api import EngineConfig
        from drivetrain.api.config import ModelConfig, OffloadConfig

        super().__init__(
            EngineConfig(
                model=ModelConfig(value_head=value_head),
                offload=OffloadConfig(params=params, optimizer=optimizer),
            )
        )
        self.moves, self.flags = [], []

    def _modules(self):
        probe = self

        class Module:
            def train(self, on):
                probe.flags.append(on)

        return [Module()]

    def _move(self, *, to_host, model, optimizer):
        self.moves.append((to_host, model, optimizer))

    def initialize(self): ...
    def forward_backward(self, batch, loss_fn, *, outputs=None): ...
    def infer(self, batch, outputs): ...
    def optimizer_zero_grad(self): ...
    def optimizer_step(self): ...
    def lr_scheduler_step(self): ...
    def export_weights(self, *, adapter_only=False): ...
    def save_checkpoint(self, path, *, step): ...
    def load_checkpoint(self, path): ...
    @property
    def parallel(self): ...


def test_modes_bring_state_in_and_idle_offloads_only_what_the_config_says():
    engine = _Probe(params=True)
    with engine.train_mode(), engine.eval_mode():
        pass
    assert engine.moves == [
        (False, True, True),  # train: parameters and optimizer on the device
        (False, True, False),  # eval: parameters only
        (False, True, True),  # back to train
        (True, True, False),  # idle: offload.params, not the optimizer
    ]
    assert engine.flags == [True, False, True]
    engine.to("cpu", model=False, optimizer=False)  # nothing asked: nothing moves
    assert len(engine.moves) == 4
    with pytest.raises(ValueError, match="device must be 'cpu' or 'device'"):
        engine.to("cuda")


@pytest.mark.parametrize(
    ("value_head", "spec", "ok"),
    [
        (False, OutputSpec(), True),
        (False, OutputSpec(log_probs=False, values=True), False),
        (True, OutputSpec(log_probs=False, values=True), True),
        (True, OutputSpec(values=True), False),  # values and log-probs at once
        (True, OutputSpec(), False),
    ],
)
def test_output_checks_follow_the_value_head(value_head, spec, ok):
    engine = _Probe(value_head=value_head)
    if ok:
        engine._check_outputs(spec)
    else:
        with pytest.raises(EngineStateError, match="engine cannot compute"):
            engine._check_outputs(spec)
    default = engine._training_outputs(None)
    assert default.names == (("values",) if value_head else ("log_probs",))
