"""Packed attention through one variable-length kernel call (``packed_kernels``).

The CUDA kernels (flash-attn's, PyTorch's ``varlen_attn``) do not run on the CPU, so the path
around them (the layout of spans and shared prefixes, the gathers, the call count, the choice
of kernel) is checked here with a CPU kernel of the same contract: causal attention per
document, aligned bottom-right. On a GPU (``gpu`` mark) the real kernels are checked against
the grouped SDPA path."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from drivetrain.engine_core import packed_kernels
from drivetrain.engine_core.packed_attention import Span, attend_spans, plain_spans
from drivetrain.engine_core.packed_kernels import (
    attend_varlen,
    choose_kernel,
    installed_kernels,
    varlen_layout,
)
from drivetrain.testing.torch_engines.kernels import ReferenceKernel


@pytest.fixture
def reference(monkeypatch):
    kernel = ReferenceKernel()
    monkeypatch.setitem(packed_kernels.VARLEN_KERNELS, "reference", kernel)
    return kernel


def _prefix_spans(rng: random.Random, groups: int) -> list[Span]:
    """GRPO's layout: per group a prompt, then each sample's own tokens seeing that prompt."""
    spans, at = [], 0
    for _ in range(groups):
        prompt = rng.randint(2, 12)
        spans.append(Span(at, prompt))
        prompt_at, at = at, at + prompt
        for _ in range(rng.randint(1, 4)):
            own = rng.randint(1, 20)
            spans.append(Span(at, own, prompt_at, prompt))
            at += own
    spans.append(Span(at, rng.randint(1, 9)))  # a plain document after them
    return spans


def _rows(total: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(total)
    return [
        torch.randn(1, 4, total, 16, dtype=torch.float64, generator=gen).requires_grad_()
        for _ in range(3)
    ]


@pytest.mark.parametrize("documents", [1, 10, 100])
def test_one_call_equals_the_grouped_path_plain_documents(documents, reference):
    rng = random.Random(documents)
    cu = list(itertools.accumulate([rng.randint(1, 40) for _ in range(documents)], initial=0))
    spans = plain_spans(cu)
    q, k, v = _rows(cu[-1])
    want = attend_spans(q, k, v, spans, 0.0, None)
    got = attend_varlen(q, k, v, varlen_layout(spans, q.device), reference, 0.0, None)
    _same_values_and_grads(got, want, (q, k, v))
    assert reference.calls == 1


def test_one_call_equals_the_grouped_path_with_shared_prefixes(reference):
    spans = _prefix_spans(random.Random(0), groups=6)
    q, k, v = _rows(sum(s.length for s in spans))
    layout = varlen_layout(spans, q.device)
    assert layout.key_index is not None and len(layout.key_index) == sum(s.keys for s in spans)
    want = attend_spans(q, k, v, spans, 0.0, 0.3)
    got = attend_varlen(q, k, v, layout, reference, 0.0, 0.3)
    _same_values_and_grads(got, want, (q, k, v))


def _same_values_and_grads(got, want, inputs):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    g = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(1))
    for a, b in zip(
        torch.autograd.grad((want * g).sum(), inputs),
        torch.autograd.grad((got * g).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-10)


def test_the_kernel_choice():
    cuda = ("flash_attn", "torch_varlen", "grouped_sdpa")
    assert choose_kernel("auto", "cuda", cuda) == "flash_attn"
    assert choose_kernel("auto", "cuda", cuda[1:]) == "torch_varlen"
    assert choose_kernel("auto", "cpu", ("grouped_sdpa",)) == "grouped_sdpa"
    assert choose_kernel("grouped_sdpa", "cuda", cuda) == "grouped_sdpa"
    assert installed_kernels("cpu") == ("grouped_sdpa",)
    assert "torch_varlen" in installed_kernels("cuda")  # the locked torch ships varlen_attn
    assert installed_kernels("cuda", "float32") == ("grouped_sdpa",)  # flash: 16-bit only
    with pytest.raises(ValueError, match="needs a CUDA device"):
        choose_kernel("torch_varlen", "cpu", ("grouped_sdpa",))
    with pytest.raises(ValueError, match="is not installed"):
        choose_kernel("flash_attn", "cuda", cuda[1:])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels_equal_the_grouped_path(dtype):
    spans = _prefix_spans(random.Random(1), groups=8)
    total = sum(s.length for s in spans)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, 8, total, 64, device="cuda", dtype=dtype, generator=gen).requires_grad_()
        for _ in range(3)
    )
    want = attend_spans(q, k, v, spans, 0.0, None)
    for name in installed_kernels("cuda")[:-1]:
        kernel = packed_kernels.VARLEN_KERNELS[name]
        got = attend_varlen(q, k, v, varlen_layout(spans, q.device), kernel, 0.0, None)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=name)
        g = torch.randn_like(want)
        for a, b in zip(
            torch.autograd.grad((want * g).sum(), (q, k, v), retain_graph=True),
            torch.autograd.grad((got * g).sum(), (q, k, v)),
            strict=True,
        ):
            torch.testing.assert_close(b, a, rtol=5e-2, atol=5e-2, msg=name)
