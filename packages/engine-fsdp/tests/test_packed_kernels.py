"""The fsdp engine's packed attention through a variable-length kernel: one call per layer
whatever the number of documents (with the CPU reference kernel of
``drivetrain.testing.torch_engines.kernels``, whose contract the CUDA kernels share), and a
kernel that cannot run here refused in one line."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from drivetrain.api import ConfigError, MicroBatchConfig
from drivetrain.engine.fsdp.attention import NAME, set_packed_row
from drivetrain.engine_core import packed_kernels
from drivetrain.engine_core.packed_attention import plain_spans
from drivetrain.testing.torch_engines.kernels import ReferenceKernel
from fsdp_harness import FSDPHarness, build_tiny_model


@pytest.fixture
def reference(monkeypatch):
    kernel = ReferenceKernel()
    monkeypatch.setitem(packed_kernels.VARLEN_KERNELS, "reference", kernel)
    return kernel


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.mark.parametrize("documents", [1, 10, 100])
def test_a_packed_micro_batch_costs_one_attention_call_per_layer(documents, reference, model_dir):
    """The guard for the GPU path: the call count does not grow with the documents."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=NAME)
    rng = random.Random(documents)
    lengths = [rng.randint(1, 12) for _ in range(documents)]
    cu = list(itertools.accumulate(lengths, initial=0))
    ids = torch.randint(3, 60, (1, cu[-1]))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    set_packed_row(plain_spans(cu), None, "reference")
    with torch.no_grad():
        via_kernel = model(input_ids=ids, position_ids=positions).logits
    assert reference.calls == model.config.num_hidden_layers
    set_packed_row(plain_spans(cu), None, "grouped_sdpa")
    with torch.no_grad():
        grouped = model(input_ids=ids, position_ids=positions).logits
    torch.testing.assert_close(via_kernel, grouped, rtol=1e-5, atol=1e-5)


def test_a_cuda_kernel_asked_for_on_the_cpu_is_one_config_error(model_dir):
    harness = FSDPHarness(model_dir, overrides={"packed_kernel": "torch_varlen"})
    with pytest.raises(ConfigError, match="packed_kernel='torch_varlen' needs a CUDA device"):
        harness.make_engine(MicroBatchConfig(2))
    with pytest.raises(ConfigError, match="packed_kernel='xformers' is not one of auto"):
        FSDPHarness(model_dir, overrides={"packed_kernel": "xformers"}).make_engine(
            MicroBatchConfig(2)
        )


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ulysses_attends_through_one_kernel_call_per_layer(tmp_path):
    """Two ranks of a sequence-parallel group: the all-to-alls around one kernel call give the
    grouped path's values and gradients on the whole row (shared prefixes and one KV head too)."""
    from launch import launch

    reports = launch("worker_ulysses_kernel.py", tmp_path, timeout=100)
    for report in reports:
        assert set(report) == {"plain/kv2", "plain/kv1", "shared_prefix/kv2", "shared_prefix/kv1"}
        for case, result in report.items():
            assert result["calls"] == 1, case
            assert result["max_error"] < 1e-5, (case, result)
