"""Grouped document attention equals one causal SDPA call per document (values and grads)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from drivetrain.engine_core.packed_attention import (
    Span,
    attend_documents,
    attend_spans,
    length_groups,
)


def _per_document(q, k, v, cu):
    return torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
            for a, b in itertools.pairwise(cu)
            if b > a
        ],
        dim=2,
    )


def _assert_same_values_and_grads(got, want, inputs, gen):
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    g = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    for a, b in zip(
        torch.autograd.grad((want * g).sum(), inputs),
        torch.autograd.grad((got * g).sum(), inputs),
        strict=True,
    ):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "lengths",
    [
        [5, 7, 30, 31, 29, 1, 64, 9, 9, 9],
        [random.Random(0).randint(1, 40) for _ in range(200)],
        [200, 3, 700],
        [4, 0, 6],  # an empty document
        [16] * 8,  # equal documents back to back: one view, nothing gathered or reordered
        [8, 8, 8, 40, 40],  # two such groups, already in row order
        [40, 8, 8, 40],  # equal lengths apart in the row: gathered, then reordered
    ],
)
def test_matches_per_document_attention(lengths):
    cu = tuple(itertools.accumulate(lengths, initial=0))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, cu[-1], 16, dtype=torch.float64, generator=gen).requires_grad_()
        for _ in range(3)
    )
    want, got = _per_document(q, k, v, cu), attend_documents(q, k, v, cu, 0.0, None)
    _assert_same_values_and_grads(got, want, (q, k, v), gen)


def test_groups_bound_the_padding():
    groups = length_groups([10, 11, 100, 12, 0, 30, 99])
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3, 5, 6]  # the empty one dropped
    assert [0, 1, 3] in groups and [6, 2] in groups and [5] in groups


def test_spans_with_a_shared_prefix_match_separate_sequences():
    """Row [prompt, own 1, own 2, own 3, other doc]: each own span sees the prompt, then
    itself causally — as if every sample carried its own copy of the prompt."""
    prompt, owns, other = 6, [3, 1, 5], 4
    gen = torch.Generator().manual_seed(1)
    total = prompt + sum(owns) + other
    q, k, v = (
        torch.randn(1, 2, total, 8, dtype=torch.float64, generator=gen).requires_grad_()
        for _ in range(3)
    )
    spans, at = [Span(0, prompt)], prompt
    for n in owns:
        spans.append(Span(at, n, 0, prompt))
        at += n
    spans.append(Span(at, other))
    got = attend_spans(q, k, v, spans, 0.0, None)
    # reference: every sample expanded to its own [prompt; own] sequence
    want = torch.zeros_like(got)
    for span in spans:
        index = torch.cat(
            [torch.arange(span.prefix_start, span.prefix_start + span.prefix_len),
             torch.arange(span.start, span.start + span.length)]
        )  # fmt: skip
        out = F.scaled_dot_product_attention(
            q[:, :, index], k[:, :, index], v[:, :, index], is_causal=True
        )
        want = want.index_add(2, index[span.prefix_len :], out[:, :, span.prefix_len :])
    _assert_same_values_and_grads(got, want, (q, k, v), gen)
