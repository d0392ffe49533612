"""Packed attention in engine-fsdp: one SDPA call per group of similar-length documents
(``attend_documents``) vs one SDPA call per document (its previous form), side by side.

Forward + backward over a packed row of 256 documents of 15-35 tokens (GRPO's short answers),
4 heads of 32, fp32, one thread; the two forms interleaved (``timing.py``: one warm-up round,
at least 5 timed rounds, one ratio per round). The last line is JSON with
``speedup_vs_per_document`` (median) and its spread.
Usage: uv run python benchmarks/packed_attention.py [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics

import torch
import torch.nn.functional as F
from timing import add_arguments, interleaved, print_result, rounds_of, speedup

from drivetrain.engine.fsdp.attention import attend_documents


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[int, ...]):
    return torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
            for a, b in itertools.pairwise(cu)
        ],
        dim=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    rounds = rounds_of(parser.parse_args())
    torch.set_num_threads(1)
    rng = random.Random(0)
    cu = tuple(itertools.accumulate((rng.randint(15, 35) for _ in range(256)), initial=0))
    q, k, v = (torch.randn(1, 4, cu[-1], 32, requires_grad=True) for _ in range(3))
    times = interleaved(
        {
            "per_document": lambda: per_document(q, k, v, cu).sum().backward(),
            "grouped": lambda: attend_documents(q, k, v, cu, 0.0, None).sum().backward(),
        },
        rounds,
    )
    loop, grouped = (statistics.median(times[n]) for n in ("per_document", "grouped"))
    ratio = speedup(times, "grouped", "per_document")
    print(f"{'':22}{'fwd+bwd s':>10}")
    print(f"{'per document':22}{loop:>10.4f}")
    print(f"{'grouped by length':22}{grouped:>10.4f}")
    print(f"{'speedup':22}{ratio}")
    print_result(
        {"speedup_vs_per_document": ratio},
        documents=256, tokens=cu[-1], per_document_s=round(loop, 4), grouped_s=round(grouped, 4),
        rounds=rounds,
    )  # fmt: skip


if __name__ == "__main__":
    main()
