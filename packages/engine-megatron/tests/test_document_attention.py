"""megatron attends within each document of a packed row: one kernel call per layer for a
micro-batch of 1, 10 or 100 documents, no tensor the size of a ``[T, T]`` score matrix (the
first H100 run ran out of memory on one: heads x T^2 x 4 bytes), and log-probs equal to the
grouped SDPA path. One rank; the variable-length kernel is the CPU reference of the same
contract as the CUDA ones (``drivetrain.testing.torch_engines.kernels``)."""

import pytest

from megatron_harness import build_tiny_model
from megatron_launch import launch

LAYERS = 4  # build_tiny_model's


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama")
    out = tmp_path_factory.mktemp("document-attention")
    (ranks,) = launch("worker_document_attention.py", out, model_dir, nproc=1, timeout=240)
    return ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("documents", [1, 10, 100])
def test_one_kernel_call_per_layer_and_no_score_matrix_over_the_row(results, documents):
    got = results[documents]
    assert got["calls"] == LAYERS
    tokens = got["tokens"]
    if documents == 100:  # ~1,600 tokens: the row's fp32 scores would be 40 MB, its
        # logits 1.6 MB; every tensor stays far below one head's scores
        assert got["largest_bytes"] < tokens * tokens * 4 / 4, (got["largest_bytes"], tokens)
    for via_kernel, grouped in zip(*got["log_probs"].values(), strict=True):
        assert via_kernel == pytest.approx(grouped, abs=1e-5)


def test_log_probs_in_checkpointed_chunks_train_the_same(results):
    whole, chunked = results["chunked"][None], results["chunked"][7]
    assert chunked == pytest.approx(whole, rel=1e-6)
