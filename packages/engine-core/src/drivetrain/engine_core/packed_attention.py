"""Causal attention over a packed row, one document at a time: the grouped SDPA path.

A packed row holds several documents back to back; attention must not cross a document
boundary and should cost about sum(len_i^2), not T^2. Spans of similar length are padded into
one batched SDPA call each (a per-document loop measured faster than one block-diagonal mask
on CPU, but thousands of short RL sequences made the loop's per-call overhead dominate,
backward most of all). That loop sliced each document out of the row, and each slice's
backward fills a zero gradient the size of the row. A loop over ``split`` views has no such
cost, and ``benchmarks/packed_attention.py`` measures it faster than this grouping on 256 short
documents; moving to it is still to do. On CUDA a variable-length kernel takes the whole row
in one call instead (:mod:`drivetrain.engine_core.packed_kernels`).

A span may also see a *shared prefix* elsewhere in the row: samples that start with the same
prompt carry it once, and each sample's own tokens attend to that copy and then causally to
themselves. Both engines (fsdp through transformers' attention interface, megatron through its
core-attention module) call these functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Span:
    """Queries at row positions ``[start, start + length)``: they attend to the ``prefix_len``
    keys at ``[prefix_start, ...)`` (a shared prompt), then causally to their own positions."""

    start: int
    length: int
    prefix_start: int = 0
    prefix_len: int = 0

    @property
    def keys(self) -> int:
        return self.prefix_len + self.length


def plain_spans(cu_seqlens: Sequence[int]) -> tuple[Span, ...]:
    """One span per document of a packed row given by its offsets."""
    return tuple(Span(a, b - a) for a, b in itertools.pairwise(cu_seqlens))


#: documents whose lengths differ by at most this factor (or by SLACK tokens) share one call
GROUP_RATIO, SLACK = 1.25, 8


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Document indices grouped by similar length (padding waste bounded by GROUP_RATIO)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= max(
            lengths[groups[-1][0]] * GROUP_RATIO, lengths[groups[-1][0]] + SLACK
        ):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def attend_documents(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: tuple[int, ...],
    dropout: float,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention within each document of a packed ``[1, h, T, d]`` row."""
    return attend_spans(query, key, value, plain_spans(cu_seqlens), dropout, scale)


def attend_spans(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: Sequence[Span],
    dropout: float,
    scale: float | None,
) -> torch.Tensor:
    """Attention of a packed ``[1, h, T, d]`` row whose spans cover every position once."""
    spans = [s for s in spans if s.length > 0]
    device = query.device
    pieces: list[torch.Tensor] = []  # [h, queries, d] each
    positions: list[range | torch.Tensor] = []  # the row positions of each piece's queries
    for group in length_groups([s.keys for s in spans]):
        members = [spans[i] for i in group]
        if _back_to_back(members):  # a plain view: no gather, no mask, nothing to reorder
            a, n, g = members[0].start, members[0].length, len(members)
            q, k, v = (
                t[0, :, a : a + g * n].unflatten(1, (g, n)).transpose(0, 1)
                for t in (query, key, value)
            )
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scale
            )  # [g, h, n, d]
            pieces.append(out.transpose(0, 1).flatten(1, 2))
            positions.append(range(a, a + g * n))
            continue
        fields = torch.tensor(
            [(s.start, s.length, s.prefix_start, s.prefix_len) for s in members], device=device
        )
        start, length, pstart, plen = (fields[:, j : j + 1] for j in range(4))  # [g, 1] each
        q_offs = torch.arange(max(s.length for s in members), device=device)[None, :]
        k_offs = torch.arange(max(s.keys for s in members), device=device)[None, :]
        q_valid, k_valid = q_offs < length, k_offs < plen + length  # [g, Lq], [g, Lk]
        # padding reads the span's first query / key (finite values, never attended from)
        q_index = torch.where(q_valid, start + q_offs, start)
        k_index = torch.where(k_offs < plen, pstart + k_offs, start + k_offs - plen)
        k_index = torch.where(k_valid, k_index, k_index[:, :1])
        q = query[0][:, q_index].transpose(0, 1)  # [g, h, Lq, d]
        k, v = (t[0][:, k_index].transpose(0, 1) for t in (key, value))  # [g, h, Lk, d]
        # query j of a span sits at key position prefix_len + j: causal, bottom-right aligned
        visible = k_offs[:, None, :] <= (plen + q_offs)[:, :, None]  # [g, Lq, Lk]
        mask = (visible & k_valid[:, None, :])[:, None]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale
        )
        pieces.append(out.transpose(0, 1)[:, q_valid])  # [h, valid queries, d]
        positions.append(q_index[q_valid])
    out = torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    if _in_order(positions):  # equal documents packed back to back: the usual SFT row
        return out.unsqueeze(0)
    index = [
        torch.arange(p.start, p.stop, device=device) if isinstance(p, range) else p
        for p in positions
    ]
    return out[:, torch.argsort(torch.cat(index))].unsqueeze(0)


def _back_to_back(members: Sequence[Span]) -> bool:
    """Whether the spans have one length, no prefix, and follow each other in the row."""
    a, n = members[0].start, members[0].length
    return all(
        s.length == n and not s.prefix_len and s.start == a + j * n for j, s in enumerate(members)
    )


def _in_order(positions: Sequence[range | torch.Tensor]) -> bool:
    """Whether the pieces' positions, concatenated, are 0, 1, 2, ... (a host-side check)."""
    at = 0
    for p in positions:
        if not isinstance(p, range) or p.start != at:
            return False
        at = p.stop
    return True
