"""A CPU kernel of the variable-length attention contract, for tests of the paths around the
CUDA kernels (layouts, gathers, call counts) on machines without a GPU: causal attention per
document, aligned bottom-right, one SDPA call per document. It counts its calls."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


class ReferenceKernel:
    """Register it in ``packed_kernels.VARLEN_KERNELS`` under a name of the test's choosing."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
        cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None, dropout: float,
    ) -> torch.Tensor:  # fmt: skip
        self.calls += 1
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int(
            (cu_k[1:] - cu_k[:-1]).max()
        )
        out = []
        for (a, b), (c, d) in zip(
            itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True
        ):
            qi, ki, vi = (t.transpose(0, 1) for t in (q[a:b], k[c:d], v[c:d]))
            visible = torch.ones(b - a, d - c, dtype=torch.bool).tril(diagonal=(d - c) - (b - a))
            out.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=visible, scale=scale))
        return torch.cat([o.transpose(0, 1) for o in out])
