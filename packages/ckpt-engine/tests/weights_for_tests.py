"""Deterministic weight streams for the transport tests: tensors larger than a bucket, many
tiny ones, bf16/fp32/int mixes, a scalar, an empty tensor and a tied (shared) pair."""

from __future__ import annotations

import torch


def make_weights(seed: int, *, big: int = 3000, tiny: int = 40) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(64, 16, generator=g)
    weights = [
        ("model.embed_tokens.weight", embed),
        ("model.big.weight", torch.randn(big, 7, generator=g)),  # 84 kB fp32 > bucket
        ("model.bf16.weight", torch.randn(33, 5, generator=g).to(torch.bfloat16)),
        ("model.half_big.weight", torch.randn(2 * big, 3, generator=g).to(torch.bfloat16)),
        ("model.steps", torch.tensor(7, dtype=torch.int64)),
        ("model.empty", torch.empty(0, 4)),
        ("model.mask", torch.rand(5, 3, generator=g) > 0.5),
    ]
    weights += [(f"model.tiny.{i}", torch.randn(i % 5 + 1, generator=g)) for i in range(tiny)]
    weights.append(("lm_head.weight", embed))  # tied: the same tensor under two names
    return weights
