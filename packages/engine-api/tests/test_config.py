import math

import pytest

from drivetrain.api import ConfigError, MicroBatchConfig, OptimConfig
from drivetrain.api.config import LoraConfig, ModelConfig
from drivetrain.runtime.schedule import lr_multiplier


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: OptimConfig(lr=0), "optim.lr=0 must be > 0"),
        (lambda: OptimConfig(scheduler="step"), "not one of constant, linear, cosine"),
        (lambda: lr_multiplier(0, OptimConfig(scheduler="cosine")), "needs optim.total_steps"),
        (lambda: lr_multiplier(0, OptimConfig(warmup_ratio=0.1)), "needs optim.total_steps"),
        (lambda: OptimConfig(betas=(0.9, 1.5)), "betas"),
        (lambda: MicroBatchConfig(), "exactly one"),
        (lambda: MicroBatchConfig(micro_batch_size=2, max_tokens=8), "exactly one"),
        (lambda: ModelConfig(dtype="int8"), "float32, bfloat16"),
        (lambda: LoraConfig(dropout=1.0), "dropout"),
    ],
)
def test_invalid_values_name_the_valid_choices(factory, message):
    with pytest.raises(ConfigError, match=message):
        factory()


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        OptimConfig().lr = 1.0


def test_warmup_then_cosine_to_floor():
    cfg = OptimConfig(scheduler="cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert [lr_multiplier(s, cfg) for s in (0, 1)] == pytest.approx([1 / 3, 2 / 3])
    assert lr_multiplier(2, cfg) == pytest.approx(1.0)
    assert lr_multiplier(6, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(10, cfg) == pytest.approx(0.1)
    assert lr_multiplier(50, cfg) == pytest.approx(0.1)


def test_linear_decay_and_warmup_ratio():
    cfg = OptimConfig(scheduler="linear", warmup_ratio=0.1, total_steps=20)
    assert lr_multiplier(2, cfg) == pytest.approx(1.0)
    assert lr_multiplier(11, cfg) == pytest.approx(0.5)
    assert lr_multiplier(5, OptimConfig()) == 1.0
