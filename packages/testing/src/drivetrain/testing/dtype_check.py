"""The conformance check of output dtypes and devices: ``infer`` returns the dtypes
:data:`~drivetrain.api.columns.DTYPES` names (log-probs and entropy float32 whatever the
model's dtype) as CPU values, and a training step in each model dtype is finite."""

from __future__ import annotations

import unittest

from drivetrain.api.columns import DTYPES
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.loss import OutputSpec
from drivetrain.testing.harness import EngineHarness
from drivetrain.testing.steps import data, is_finite, make, train_step

SPLIT = MicroBatchConfig(micro_batch_size=3)


def check_output_dtypes(h: EngineHarness) -> None:
    """For every dtype in ``h.model_dtypes`` (default: the harness's own): infer's columns have
    the contract's dtypes (``h.dtype_of``) on the CPU (``h.device_of``, if the harness has it),
    and a training step gives a finite loss and gradient norm."""
    dtype_of = getattr(h, "dtype_of", None)
    if dtype_of is None:
        raise unittest.SkipTest("the harness has no dtype_of(value)")
    device_of = getattr(h, "device_of", None)
    spec = OutputSpec(log_probs=True, entropy=True)
    for dtype in getattr(h, "model_dtypes", (None,)):
        engine = make(h, SPLIT, dtype=dtype) if dtype else make(h, SPLIT)
        batch = data(h)
        with engine.eval_mode():
            out = engine.infer(engine.parallel.shard_of(batch), spec)
        run = train_step(h, engine, batch)
        engine.close()
        model = f"model.dtype={dtype}" if dtype else "the harness's model dtype"
        assert is_finite(run.loss) and is_finite(run.grad_norm), (
            f"a training step with {model} gave loss {run.loss!r}, grad norm {run.grad_norm!r}"
        )
        if out is None:
            continue
        for name in spec.names:
            got = dtype_of(out[name])
            assert got == DTYPES[name], (
                f"infer's {name} are {got} with {model}: the contract says {DTYPES[name]} "
                "(api.columns.DTYPES)"
            )
            where = device_of(out[name]) if device_of is not None else "cpu"
            assert where == "cpu", f"infer returned {name} on {where}: outputs are CPU values"
