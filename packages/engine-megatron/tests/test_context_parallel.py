"""Context parallel: the load-balanced split of packed sequences and its inverse (pure tensor
functions, on CPU), the CP output gather with its keep-local backward (2 gloo processes), the
refusal on CPU, and a GPU conformance run at CP=2 (needs 2 GPUs and TransformerEngine)."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from drivetrain.engine.megatron.context import (
    check_context_parallel_available,
    chunk_index,
    padded_lengths,
    real_positions,
    split,
    unsplit,
)

lengths_st = st.lists(st.integers(1, 40), min_size=1, max_size=6)


def test_hand_case_cp2():
    # one sequence of 8 tokens, CP=2: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1, 2
    assert chunk_index([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_index([8], 2, 1).tolist() == [2, 3, 4, 5]
    # two sequences (4 and 8 tokens) are split each on its own
    assert chunk_index([4, 8], 2, 0).tolist() == [0, 3, 4, 5, 10, 11]
    assert padded_lengths([5, 8, 1], 2) == [8, 8, 4]
    assert padded_lengths([5], 2, multiple=2) == [8]


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([1, 2, 3, 4]), multiple=st.sampled_from([1, 2]))
def test_split_then_unsplit_is_identity(lengths, cp, multiple):
    padded = padded_lengths(lengths, cp, multiple)
    row = torch.arange(sum(padded)) * 10 + 7
    parts = [split(row, padded, cp, r) for r in range(cp)]
    assert len({p.numel() for p in parts}) == 1  # every rank holds as many tokens
    order = torch.cat([chunk_index(padded, cp, r) for r in range(cp)])
    assert sorted(order.tolist()) == list(range(sum(padded)))  # a permutation: nothing lost
    assert torch.equal(unsplit(parts, padded), row)
    real = real_positions(lengths, padded)
    assert real.numel() == sum(lengths)


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, cp=st.sampled_from([2, 4]))
def test_split_is_load_balanced(lengths, cp):
    """Causal attention work of a chunk grows with its position: rank r pairs chunk r with chunk
    2cp-1-r, so every rank's sum of chunk positions is the same."""
    padded = padded_lengths(lengths, cp)
    offsets = torch.tensor([0, *padded]).cumsum(0)[:-1]
    work = []
    for rank in range(cp):
        index = chunk_index(padded, cp, rank)
        seq = torch.bucketize(index, offsets, right=True) - 1
        work.append(int((index - offsets[seq]).sum()))  # position within its own sequence
    assert len(set(work)) == 1


def test_split_along_other_dim():
    padded = [4]
    row = torch.arange(8).view(2, 4)
    assert split(row, padded, 2, 0, dim=1).tolist() == [[0, 3], [4, 7]]
    assert torch.equal(unsplit([split(row, padded, 2, r, dim=1) for r in range(2)], padded, dim=1),
                       row)  # fmt: skip


def test_context_parallel_refused_on_cpu():
    with pytest.raises(ValueError, match="CUDA-only"):
        check_context_parallel_available(on_cpu=True)


def test_context_parallel_refused_without_transformer_engine():
    pytest.importorskip("torch")
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="TransformerEngine"):
            check_context_parallel_available(on_cpu=False)
    else:
        check_context_parallel_available(on_cpu=False)


def test_engine_config_refuses_cp_on_cpu(tmp_path):
    from transformers import AutoConfig

    from drivetrain.engine.megatron.model import transformer_config
    from megatron_harness import build_tiny_model

    path = build_tiny_model(str(tmp_path / "m"), family="llama", layers=1)
    with pytest.raises(ValueError, match="context_parallel > 1 needs TransformerEngine"):
        transformer_config(
            AutoConfig.from_pretrained(path), dtype=torch.float32, tensor_parallel=1,
            pipeline_parallel=1, virtual_pipeline=None, context_parallel=2,
            sequence_parallel=False, recompute=False, device="cpu",
        )  # fmt: skip


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_cp_gather_restores_order_and_keeps_local_grads(tmp_path):
    """Two ranks as one CP group: the gathered per-token values are the original row's real
    tokens in order, and the backward of a loss computed on every rank gives each rank exactly
    the gradient of its own tokens (not CP times it)."""
    from megatron_launch import launch

    ranks = launch("worker_context_parallel.py", tmp_path, json.dumps([5, 9, 3]), timeout=100)
    for result in ranks:
        assert result["gathered"] == result["expected"]
        assert result["grad"] == result["expected_grad"]


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_conformance_at_cp2(tmp_path):
    """The engine-api conformance kit at CP=2 (2 GPUs, TransformerEngine installed)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    pytest.importorskip("transformer_engine")
    from megatron_harness import build_tiny_model
    from megatron_launch import launch

    model_dir = build_tiny_model(str(tmp_path / "llama"), family="llama")
    cases = [{"overrides": {"context_parallel": 2, "device": "cuda"}, "run": ["conformance"]}]
    (result,) = launch("worker_engine.py", tmp_path, model_dir, json.dumps(cases), timeout=800)[0]
    failures = [c for c in result["result"] if not c["passed"]]
    assert not failures, json.dumps(failures, indent=1)[:4000]
