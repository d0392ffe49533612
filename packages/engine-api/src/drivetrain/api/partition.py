"""Pure-Python partitioning of samples by their token counts.

Used twice by every engine and the trainer: to give each data-parallel rank about the same
number of tokens, and to cut a rank's mini-batch into micro-batches under a token budget
("dynamic batch size"). Both return lists of sample indices, ascending within each part, so the
caller can restore the original order from them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from drivetrain.api.errors import BatchError


def balanced_partition(
    weights: Sequence[int], parts: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Split indices ``0..len(weights)-1`` into ``parts`` non-empty groups of similar total weight.

    Greedy longest-processing-time: heaviest first, each into the currently lightest group. The
    heaviest group weighs at most ``sum/parts + max(weights)`` (the list-scheduling bound).
    With ``equal_size`` every group gets ``len/parts`` samples (``len`` must divide evenly),
    for callers that need the same number of samples per rank.
    """
    n = len(weights)
    if parts < 1:
        raise BatchError(f"parts must be >= 1, got {parts}")
    if n < parts:
        raise BatchError(f"cannot split {n} samples into {parts} non-empty parts")
    if any(w < 0 for w in weights):
        raise BatchError("weights must be non-negative")
    capacity = n  # unlimited
    if equal_size:
        if n % parts:
            raise BatchError(f"equal_size needs {n} samples to divide by {parts} parts")
        capacity = n // parts
    order = sorted(range(n), key=lambda i: (-weights[i], i))
    groups: list[list[int]] = [[] for _ in range(parts)]
    # heap of (load, count, group id); full groups are dropped from the heap
    heap = [(0, 0, g) for g in range(parts)]
    for i in order:
        load, count, g = heapq.heappop(heap)
        groups[g].append(i)
        if count + 1 < capacity:
            heapq.heappush(heap, (load + weights[i], count + 1, g))
    for group in groups:
        group.sort()
    return groups


def token_budget_partition(
    lengths: Sequence[int], max_tokens: int, *, min_parts: int = 1
) -> list[list[int]]:
    """Group samples into as few balanced micro-batches as fit ``max_tokens`` tokens each.

    ``min_parts`` lets distributed engines agree on a common micro-batch count (every rank runs
    the same number of forward passes, which FSDP's and Megatron's collectives require): each
    rank computes its count, the engine all-reduces the maximum and calls this again with it.
    A single sample longer than ``max_tokens`` is an error, never silently truncated.
    """
    if max_tokens < 1:
        raise BatchError(f"max_tokens must be >= 1, got {max_tokens}")
    too_long = [i for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i = too_long[0]
        raise BatchError(
            f"sample {i} has {lengths[i]} tokens, more than max_tokens={max_tokens} per "
            "micro-batch; raise the token budget or truncate the data"
        )
    if not lengths:
        return [[] for _ in range(min_parts)] if min_parts > 1 else []
    parts = max(min_parts, math.ceil(sum(lengths) / max_tokens))
    while True:
        if parts > len(lengths):
            raise BatchError(f"cannot make {parts} non-empty micro-batches of {len(lengths)}")
        groups = balanced_partition(lengths, parts)
        if all(sum(lengths[i] for i in group) <= max_tokens for group in groups):
            return groups
        parts += 1


def dp_shard_indices(lengths: Sequence[int], dp_size: int) -> list[list[int]]:
    """Which samples each data-parallel rank gets: token-balanced, with equal sample counts
    when ``dp_size`` divides the batch size. The controller uses the same function to put
    outputs collected from the ranks back in order (:func:`drivetrain.api.batch.restore_order`)."""
    if dp_size == 1:
        return [list(range(len(lengths)))]
    return balanced_partition(lengths, dp_size, equal_size=len(lengths) % dp_size == 0)


def fixed_size_partition(n: int, size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` samples (the last may be smaller)."""
    if size < 1:
        raise BatchError(f"micro-batch size must be >= 1, got {size}")
    return [list(range(start, min(start + size, n))) for start in range(0, n, size)]


def chunk_sizes(n: int, chunks: int) -> list[int]:
    """Sizes of ``chunks`` contiguous pieces of ``n`` items, differing by at most one."""
    if chunks < 1:
        raise BatchError(f"chunks must be >= 1, got {chunks}")
    base, extra = divmod(n, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]


def sample_units(groups: Sequence[int]) -> list[list[int]]:
    """Indices with equal ``groups`` values together, units in order of first appearance."""
    units: dict[int, list[int]] = {}
    for index, group in enumerate(groups):
        units.setdefault(int(group), []).append(index)
    return list(units.values())


def expand_units(
    unit_parts: Sequence[Sequence[int]], units: Sequence[Sequence[int]]
) -> list[list[int]]:
    """Parts of unit indices as parts of sample indices (ascending within each part)."""
    return [sorted(i for u in part for i in units[u]) for part in unit_parts]


def inverse_permutation(order: Sequence[int]) -> list[int]:
    """``inverse[order[k]] = k``: the indices that put reordered rows back in place."""
    inverse = [-1] * len(order)
    for position, index in enumerate(order):
        if not 0 <= index < len(order) or inverse[index] != -1:
            raise BatchError(f"not a permutation of 0..{len(order) - 1}: {list(order)}")
        inverse[index] = position
    return inverse
