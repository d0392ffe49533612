"""Packed attention (engine-core, both engines' CPU path): one SDPA call per group of
similar-length documents (``attend_documents``) vs one SDPA call per document (its previous
form, written at its best: views from ``split``), side by side.

Forward + backward over a packed row of 256 documents of 15-35 tokens (GRPO's short answers),
4 heads of 32, fp32, one thread; the two forms interleaved (``timing.py``: one warm-up round,
15 timed rounds by default, one ratio per round; a unit of work is 3 forward + backward
passes, since one grouped pass takes ~25 ms, short enough for a scheduler blip to matter).
The last line is JSON with ``speedup_vs_per_document`` (median) and its spread.
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

from drivetrain.engine_core.packed_attention import attend_documents

PASSES = 3  # forward + backward passes per timed unit


def per_document(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: tuple[int, ...]):
    """One causal SDPA call per document, over ``split`` views: the backward of a split
    concatenates the documents' gradients once, where slicing each document out of the row
    (``q[:, :, a:b]``) gives every slice's backward a zero-filled row-sized gradient (256 per
    input here), which made this loop 4-14x slower, and erratic, before 2026-11-24."""
    lens = [b - a for a, b in itertools.pairwise(cu)]
    return torch.cat(
        [
            F.scaled_dot_product_attention(*views, is_causal=True)
            for views in zip(q.split(lens, 2), k.split(lens, 2), v.split(lens, 2), strict=True)
        ],
        dim=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, pairs=15)
    rounds = rounds_of(parser.parse_args())
    torch.set_num_threads(1)
    rng = random.Random(0)
    cu = tuple(itertools.accumulate((rng.randint(15, 35) for _ in range(256)), initial=0))
    q, k, v = (torch.randn(1, 4, cu[-1], 32, requires_grad=True) for _ in range(3))

    def passes(fn) -> None:
        for _ in range(PASSES):
            fn(q, k, v, cu).sum().backward()

    times = interleaved(
        {
            "per_document": lambda: passes(per_document),
            "grouped": lambda: passes(lambda *a: attend_documents(*a, 0.0, None)),
        },
        rounds,
    )
    loop, grouped = (statistics.median(times[n]) / PASSES for n in ("per_document", "grouped"))
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
