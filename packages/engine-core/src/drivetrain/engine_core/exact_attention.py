"""Attention whose result for a query depends only on that query and the keys it sees.

The rollout attends from a KV cache (one query over a left-padded cache row, or a prompt's
causal prefill) and the trainer over a packed row (documents back to back, a shared prompt once
per group): the same query meets the same keys in different places, batches and shapes, and
SDPA's kernels sum their scores in orders that depend on those shapes. Here every query's
visible keys are gathered left-aligned into a row padded to a multiple of :data:`KEY_BUCKET`
fixed by how many keys it sees, and each (query, head) runs the same fixed-shape batched
products as every other query of its bucket: the bits follow from the query, its keys and its
bucket alone. Scores, softmax and the weighted sum run in float32 (the padding contributes
exact zeros), the result is cast back to the query's dtype.

The visible keys of a query are up to a few contiguous ranges of the key rows (a cache row's
real tokens; a shared prompt then the document's own tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from drivetrain.engine_core.packed_attention import Span

#: a query seeing ``n`` keys attends over ``ceil(n / KEY_BUCKET) * KEY_BUCKET`` gathered slots
KEY_BUCKET = 16
#: gathered key slots per batched product at most (bounds the float32 score and key copies)
CHUNK_SLOTS = 1 << 18


def attend_ranges(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query`` ``[N, heads, dim]``; ``key``, ``value`` ``[M, heads, dim]`` (as many heads
    as the queries); query ``i`` sees keys ``starts[i, r] : starts[i, r] + counts[i, r]`` for
    each range ``r``, in that order (``[N, R]`` long tensors). Returns ``[N, heads, dim]``;
    a query that sees no key (a padding position) gets zeros."""
    heads, dim = query.shape[1:]
    total = counts.sum(1)
    slots = (total + KEY_BUCKET - 1) // KEY_BUCKET * KEY_BUCKET
    # one zero row after the keys: every padding slot points at it
    pad = key.shape[0]
    keys = torch.cat([key.float(), key.new_zeros(1, heads, dim, dtype=torch.float32)])
    values = torch.cat([value.float(), value.new_zeros(1, heads, dim, dtype=torch.float32)])
    out = query.new_zeros(query.shape)
    for width in [w for w in slots.unique().tolist() if w > 0]:
        rows = (slots == width).nonzero().squeeze(1)
        per_chunk = max(1, CHUNK_SLOTS // (width * heads))
        for part in rows.split(per_chunk):
            index, valid = _slot_index(starts[part], counts[part], width, pad)
            q = query[part].float().reshape(-1, 1, dim)  # [B * heads, 1, dim]
            k = keys[index].transpose(1, 2).reshape(-1, width, dim)  # [B * heads, width, dim]
            v = values[index].transpose(1, 2).reshape(-1, width, dim)
            scores = torch.bmm(q, k.transpose(1, 2)) * scale  # [B * heads, 1, width]
            hidden = ~valid.repeat_interleave(heads, 0)[:, None, :]
            weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
            out[part] = torch.bmm(weights, v).reshape(len(part), heads, dim).to(out.dtype)
    return out


def _slot_index(
    starts: torch.Tensor, counts: torch.Tensor, width: int, pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, width]`` key rows of each query's visible ranges, left-aligned, then ``pad``; and
    which slots are real."""
    slot = torch.arange(width, device=starts.device)[None, :]
    index = torch.full((starts.shape[0], width), pad, dtype=torch.long, device=starts.device)
    before = torch.zeros_like(counts[:, 0])
    for r in range(starts.shape[1]):  # slots [before, before + counts) come from range r
        offset = slot - before[:, None]
        inside = (offset >= 0) & (offset < counts[:, r, None])
        index = torch.where(inside, starts[:, r, None] + offset, index)
        before = before + counts[:, r]
    return index, slot < before[:, None]


def ranges_of_mask(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A boolean ``[B, Q, K]`` mask (query ``q`` of batch row ``b`` sees key ``k``) as one
    range per query over the batch's keys flattened to ``[B * K]``: ``(starts, counts)``,
    ``[B * Q, 1]`` each. A query whose visible keys are not contiguous is an error."""
    b, _, k = visible.shape
    counts = visible.sum(-1)
    first = visible.int().argmax(-1)  # the first visible key (0 when none)
    last = k - 1 - visible.flip(-1).int().argmax(-1)
    if bool(((last - first + 1 != counts) & (counts > 0)).any()):
        raise RuntimeError("exact attention needs each query's visible keys to be contiguous")
    base = torch.arange(b, device=visible.device)[:, None] * k
    return (base + first).reshape(-1, 1), counts.reshape(-1, 1)


def ranges_of_spans(
    spans: Sequence[Span], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed row's spans (in row order, covering every position once) as two ranges per
    query over the row's keys: the span's shared prefix, then its own positions up to the
    query. ``(starts, counts)``, ``[T, 2]`` each."""
    starts, counts = [], []
    for s in spans:
        own = torch.arange(1, s.length + 1, device=device)
        starts.append(torch.tensor([s.prefix_start, s.start], device=device).expand(s.length, 2))
        counts.append(torch.stack([torch.full_like(own, s.prefix_len), own], 1))
    if not starts:
        empty = torch.zeros(0, 2, dtype=torch.long, device=device)
        return empty, empty
    return torch.cat(starts), torch.cat(counts)
