"""``torch_compile=true`` (issue 57, item 2): the compiled decoder layers give the eager
engine's outputs, loss and step (packed rows: padded input is packed by the engine too), and
they ran through dynamo, not around it; ``numerics=exact`` refuses the option."""

from __future__ import annotations

import pytest
import torch

from drivetrain.api import ConfigError, MicroBatchConfig, ModelConfig
from drivetrain.api.loss import OutputSpec
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.testing.conformance import _assert_same_results, _infer_rows
from drivetrain.testing.steps import data, train_step
from fsdp_harness import FSDPHarness, build_tiny_model

COMPILED = {"torch_compile": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"), family="llama")


def _run(h: FSDPHarness):
    batch = data(h).to_packed()
    engine = h.make_engine(MicroBatchConfig(micro_batch_size=3))
    spec = OutputSpec(log_probs=True, entropy=True)
    try:
        return _infer_rows(h, engine, batch, spec), train_step(h, engine, batch)
    finally:
        engine.close()


@pytest.mark.timeout(600)
def test_compiled_layers_match_eager(model_dir):
    torch._dynamo.reset()
    calls = torch._dynamo.utils.counters["stats"]["calls_captured"]
    eager = FSDPHarness(model_dir, atol=1e-5, rtol=1e-4)
    compiled = FSDPHarness(model_dir, overrides=COMPILED, atol=1e-5, rtol=1e-4)
    want_rows, want_run = _run(eager)
    got_rows, got_run = _run(compiled)
    # the layers ran through dynamo (ops captured into graphs), not around it
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] > calls
    spec = OutputSpec(log_probs=True, entropy=True)
    _assert_same_results(
        compiled, spec, (got_rows, got_run), (want_rows, want_run), "compiled", "eager"
    )


def test_exact_numerics_refuses_compile(model_dir):
    with pytest.raises(ConfigError, match="torch_compile with numerics=exact"):
        FSDPConfig(model=ModelConfig(path=model_dir), torch_compile=True, numerics="exact")
