"""Attention whose result for a query depends only on that query and the keys it sees.

The rollout attends from a KV cache (one query over a left-padded cache row, or a prompt's
causal prefill) and the trainer over a packed row (documents back to back, a shared prompt once
per group): the same query meets the same keys in different places, batches and shapes, and
SDPA's kernels sum their scores in orders that depend on those shapes. Here attention runs per
*block*: queries that attend over one list of keys, query ``j`` of the block over its first
``first + j`` keys (a document, a cache row). A block's keys are gathered left-aligned and
padded to a multiple of :data:`KEY_SLOTS`, its queries padded to a multiple of
:data:`QUERY_ROWS`; blocks of one key width run as one batched product, scores and the weighted
sum in float32, the padding masked (exact zeros in the sums). Only the blocks' keys are read
(a cache is never copied whole). Measured on this machine's MKL, at
1 and 2 threads, head dims 16-128: a score's and an output's bits then depend on the query and
its keys alone, not on the block's size, the key width, the batch or its place in it (the
engine-core tests and the rollout-vs-engine tests check it bit for bit). The result is cast
back to the query's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from drivetrain.engine_core.packed_attention import Span

#: a block's keys are padded to a multiple of this (the vector width of the softmax's sums)
KEY_SLOTS = 16
#: a block's queries are padded to a multiple of this (MKL's row-invariant product shapes)
QUERY_ROWS = 4


@dataclass(frozen=True)
class Blocks:
    """``G`` blocks over query rows and key rows: block ``g`` holds the queries
    ``query_start[g] : query_start[g] + queries[g]``; its keys are ``key_starts[g, r] :
    key_starts[g, r] + key_lens[g, r]`` for each range ``r``, in that order; its query ``j``
    sees the first ``first[g] + j`` of them. Long tensors ``[G]`` and ``[G, R]``."""

    query_start: torch.Tensor
    queries: torch.Tensor
    key_starts: torch.Tensor
    key_lens: torch.Tensor
    first: torch.Tensor


def blocks_of_spans(spans: Sequence[Span], device: torch.device) -> Blocks:
    """A packed row's spans, one block each: the shared prefix, then the span's own keys."""
    spans = [s for s in spans if s.length > 0]
    table = torch.tensor(
        [[s.start, s.length, s.prefix_start, s.prefix_len] for s in spans], dtype=torch.long
    ).reshape(-1, 4)
    start, length, prefix_start, prefix_len = table.to(device).unbind(1)
    return Blocks(
        query_start=start,
        queries=length,
        key_starts=torch.stack([prefix_start, start], 1),
        key_lens=torch.stack([prefix_len, length], 1),
        first=prefix_len + 1,
    )


def blocks_of_mask(visible: torch.Tensor) -> Blocks:
    """A boolean ``[B, Q, K]`` mask (query ``q`` of batch row ``b`` sees key ``k``: a KV
    cache's padding and causal mask) as one block per batch row, over the batch's queries and
    keys flattened to ``[B * Q]`` and ``[B * K]``. Queries that see nothing (padding) are in no
    block (their output is zero). A row whose queries do not each see one more key of the
    same contiguous run than the previous is an error."""
    b, q, k = visible.shape
    counts = visible.sum(-1)  # [B, Q]
    first_key = visible.int().argmax(-1)
    last_key = k - 1 - visible.flip(-1).int().argmax(-1)
    real = counts > 0
    queries = real.sum(-1)
    start = real.int().argmax(-1)  # each row's first real query
    rows = torch.arange(b, device=visible.device)
    offset = torch.arange(q, device=visible.device)[None, :] - start[:, None]
    first = counts[rows, start]
    run = first_key[rows, start]
    expected = first[:, None] + offset
    inside = (offset >= 0) & (offset < queries[:, None])
    ok = (real == inside) & (~real | ((counts == expected) & (first_key == run[:, None])))
    ok &= ~real | (last_key - first_key + 1 == counts)
    if not bool(ok.all()):
        raise RuntimeError(
            "exact attention needs each row's queries to see one more key of one contiguous "
            "run than the query before (a causal mask over a padded cache)"
        )
    keep = queries > 0
    longest = first + queries - 1
    return Blocks(
        query_start=(rows * q + start)[keep],
        queries=queries[keep],
        key_starts=(rows * k + run)[keep, None],
        key_lens=longest[keep, None],
        first=first[keep],
    )


def attend_blocks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: Blocks, scale: float
) -> torch.Tensor:
    """``query`` ``[B, Q, heads, dim]``, ``key``/``value`` ``[B, K, kv_heads, dim]`` (views of
    any strides: only the blocks' rows are read; ``heads`` a multiple of ``kv_heads``), rows
    flattened as ``b * Q + q`` and ``b * K + k`` in ``blocks`` -> ``[B * Q, heads, dim]`` (zero
    for a query in no block)."""
    batch, length, heads, dim = query.shape
    groups = heads // key.shape[2]
    total = blocks.key_lens.sum(1)
    width = (total + KEY_SLOTS - 1) // KEY_SLOTS * KEY_SLOTS
    # one row past the queries takes every padding slot's result, dropped at the end
    out = torch.zeros(batch * length + 1, heads, dim, dtype=torch.float32, device=query.device)
    for w in width.unique().tolist():
        group = (width == w).nonzero().squeeze(1)
        rows = int(blocks.queries[group].max())
        rows += -rows % QUERY_ROWS
        q_index, counts = _query_slots(blocks, group, rows, batch * length)
        k_index = _key_slots(blocks, group, w)
        # a padding slot reads its block's first query (finite; its result is dropped)
        at = torch.where(q_index < batch * length, q_index, blocks.query_start[group, None])
        q = _fold_heads(query[at // length, at % length].float(), groups)
        k, v = (
            t[k_index // t.shape[1], k_index % t.shape[1]].float().transpose(1, 2)
            for t in (key, value)
        )  # [G, kv_heads, w, dim]
        scores = torch.matmul(q, k.transpose(2, 3)) * scale  # [G, kv_heads, groups * rows, w]
        hidden = torch.arange(w, device=query.device)[None, None, :] >= counts[:, :, None]
        hidden = hidden.repeat(1, groups, 1)[:, None]  # the rows of every head of a group
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        attended = _unfold_heads(torch.matmul(weights, v), groups)  # [G, rows, heads, dim]
        out.index_copy_(0, q_index.flatten(), attended.flatten(0, 1))
    return out[:-1].to(query.dtype)


def _fold_heads(q: torch.Tensor, groups: int) -> torch.Tensor:
    """``[G, rows, heads, dim]`` -> ``[G, kv_heads, groups * rows, dim]``: the query heads that
    share a KV head (``groups`` in a row, as transformers' ``repeat_kv`` pairs them) become
    rows of one product, so no key is copied per query head."""
    g, rows, heads, dim = q.shape
    q = q.reshape(g, rows, heads // groups, groups, dim)
    return q.permute(0, 2, 3, 1, 4).reshape(g, heads // groups, groups * rows, dim)


def _unfold_heads(out: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of :func:`_fold_heads`."""
    g, kv_heads, stacked, dim = out.shape
    rows = stacked // groups
    out = out.reshape(g, kv_heads, groups, rows, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(g, rows, kv_heads * groups, dim)


def _query_slots(
    blocks: Blocks, group: torch.Tensor, rows: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[G, rows]`` query row of each slot (``pad`` past a block's queries) and how many keys
    it sees (at least one: a padding row's result is dropped, but must not be NaN)."""
    slot = torch.arange(rows, device=group.device)[None, :]
    inside = slot < blocks.queries[group, None]
    index = torch.where(inside, blocks.query_start[group, None] + slot, pad)
    counts = torch.where(inside, blocks.first[group, None] + slot, 1)
    return index, counts


def _key_slots(blocks: Blocks, group: torch.Tensor, width: int) -> torch.Tensor:
    """``[G, width]`` key row of each slot: the block's ranges left-aligned, then its first
    key again (a padding slot is masked: its weight is an exact 0, whatever it reads)."""
    starts, lens = blocks.key_starts[group], blocks.key_lens[group]
    slot = torch.arange(width, device=group.device)[None, :]
    first = torch.where(lens[:, 0] > 0, starts[:, 0], starts[:, -1])
    index = first[:, None].expand(len(group), width).clone()
    before = torch.zeros_like(lens[:, 0])
    for r in range(starts.shape[1]):
        offset = slot - before[:, None]
        inside = (offset >= 0) & (offset < lens[:, r, None])
        index = torch.where(inside, starts[:, r, None] + offset, index)
        before = before + lens[:, r]
    return index
