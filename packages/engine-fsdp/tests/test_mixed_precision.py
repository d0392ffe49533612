"""``model.dtype=bfloat16`` on the CPU: the engine computes in bfloat16 and steps fp32 master
weights, and the kit's LR-schedule check passes it while still failing a wrong schedule.

On the first H100 run the kit said "the learning rate in effect at step 0 is 0.003906, the
schedule says 0.003333" for bfloat16: it read the LR off bfloat16 exports, whose spacing near
1 is 2^-8 = 0.0039. The engine was right (fp32 masters, below); the kit reads in fp32 now."""

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from drivetrain.api import MicroBatchConfig
from drivetrain.engine.fsdp.engine import FSDP2Engine
from drivetrain.testing.optim_checks import check_lr_schedule
from fsdp_harness import FSDPHarness, build_tiny_model

BF16 = {"model": {"dtype": "bfloat16"}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


def test_bfloat16_steps_fp32_master_weights(model_dir):
    engine = FSDPHarness(model_dir, overrides=BF16).make_engine(MicroBatchConfig(2))
    stepped = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert stepped and all(p.dtype == torch.float32 for p in stepped)
    assert all(t.dtype == torch.bfloat16 for _, t in engine.export_weights())
    engine.close()


class AppliesTooHighLr(FSDP2Engine):
    """A planted schedule bug: each update uses 1.5 x the scheduled LR."""

    def optimizer_step(self) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] *= 1.5
        try:
            return super().optimizer_step()
        finally:
            for group in self.optimizer.param_groups:
                group["lr"] /= 1.5


@dataclass
class PlantedHarness(FSDPHarness):
    def make_engine(self, micro_batch: MicroBatchConfig, **kit: Any) -> Any:
        engine = AppliesTooHighLr(self.config(micro_batch, **kit))
        engine.initialize()
        return engine


def test_the_lr_check_passes_bfloat16_and_fails_a_wrong_schedule_in_it(model_dir):
    check_lr_schedule(FSDPHarness(model_dir, overrides=BF16, atol=3e-2, rtol=3e-2))
    with pytest.raises(AssertionError, match="learning rate in effect at step 0"):
        check_lr_schedule(PlantedHarness(model_dir, overrides=BF16, atol=3e-2, rtol=3e-2))
