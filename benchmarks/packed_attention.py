"""Packed attention in engine-fsdp: one SDPA call per group of similar-length documents
(``attend_documents``) vs one SDPA call per document (its previous form), side by side.

Forward + backward over a packed row of 256 documents of 15-35 tokens (GRPO's short answers),
4 heads of 32, fp32, one thread, median of 7 after a warm-up. The last line is JSON with
``speedup_vs_per_document``.
Usage: uv run python benchmarks/packed_attention.py
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from drivetrain.engine.fsdp.attention import attend_documents


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[int, ...]):
    return torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
            for a, b in itertools.pairwise(cu)
        ],
        dim=2,
    )


def seconds(fn, q, k, v, cu) -> float:
    times = []
    for i in range(8):
        start = time.perf_counter()
        fn(q, k, v, cu).sum().backward()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    cu = tuple(itertools.accumulate((rng.randint(15, 35) for _ in range(256)), initial=0))
    q, k, v = (torch.randn(1, 4, cu[-1], 32, requires_grad=True) for _ in range(3))
    loop = seconds(per_document, q, k, v, cu)
    grouped = seconds(lambda *a: attend_documents(*a, 0.0, None), q, k, v, cu)
    print(f"{'':22}{'fwd+bwd s':>10}")
    print(f"{'per document':22}{loop:>10.4f}")
    print(f"{'grouped by length':22}{grouped:>10.4f}")
    print(json.dumps({"documents": 256, "tokens": cu[-1], "per_document_s": round(loop, 4),
                      "grouped_s": round(grouped, 4),
                      "speedup_vs_per_document": round(loop / grouped, 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
