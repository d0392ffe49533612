"""Causal attention over packed sequences, one document at a time, with optional Ulysses.

Registered with transformers as the attention implementation ``drivetrain_varlen``. Before
each forward the engine describes the packed row with :func:`set_packed_row`: its spans of
queries, over the *full* row, and the sequence-parallel group. The setting stays until the next
forward, because activation checkpointing re-runs attention during backward, possibly on
autograd's device thread (so a context variable would not do). Transformers builds no mask for
it; attention never crosses a sequence boundary, and costs about sum(len_i^2) rather than T^2:
spans of similar length are padded into one batched SDPA call each (a per-document loop
measured faster than one block-diagonal mask on CPU, but thousands of short RL sequences made
the loop's per-call overhead dominate, backward most of all). That loop sliced each document
out of the row, and each slice's backward fills a zero gradient the size of the row. A loop
over ``split`` views has no such cost, and ``benchmarks/packed_attention.py`` measures it
faster than this grouping on 256 short documents; moving to it is still to do.

A span may also see a *shared prefix* elsewhere in the row: samples that start with the same
prompt carry it once, and each sample's own tokens attend to that copy and then causally to
themselves (see :mod:`drivetrain.engine.fsdp.prefix_sharing`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from drivetrain.engine.fsdp.packed_kernels import (
    VARLEN_KERNELS,
    VarlenLayout,
    attend_varlen,
    varlen_layout,
)
from drivetrain.engine.fsdp.sequence_parallel import all_to_all

NAME = "drivetrain_varlen"


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


@dataclass(frozen=True)
class PackedContext:
    spans: tuple[Span, ...]
    sp_group: dist.ProcessGroup | None = None
    kernel: str = "grouped_sdpa"  # or a name in packed_kernels.VARLEN_KERNELS
    #: the spans' variable-length layout per device, built by the first layer, reused by the rest
    layouts: dict[torch.device, VarlenLayout] = field(default_factory=dict, compare=False)

    @property
    def total(self) -> int:
        """The row's length (spans cover every position once)."""
        return sum(s.length for s in self.spans)

    def layout(self, device: torch.device) -> VarlenLayout:
        if device not in self.layouts:
            self.layouts[device] = varlen_layout(self.spans, device)
        return self.layouts[device]


_CURRENT: list[PackedContext] = []


def set_packed_row(
    spans: Sequence[Span], sp_group: dist.ProcessGroup | None, kernel: str = "grouped_sdpa"
) -> None:
    """Describe the packed row of the next forward (kept for recomputation in backward) and
    the kernel that attends over it (``packed_kernels.choose_kernel``)."""
    _CURRENT[:] = [PackedContext(tuple(spans), sp_group, kernel)]


def _repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[1, heads, tokens, dim]`` (tokens: this rank's slice under Ulysses)."""
    if not _CURRENT:
        raise RuntimeError(f"attention '{NAME}' runs only inside drivetrain's FSDP engine")
    ctx = _CURRENT[0]
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise RuntimeError(f"attention '{NAME}' does not implement {unsupported}; use 'sdpa'")
    if query.shape[0] != 1:
        raise RuntimeError(f"attention '{NAME}' takes one packed row, got batch {query.shape[0]}")
    heads, kv_heads = query.shape[1], key.shape[1]
    if ctx.sp_group is not None:  # [1, h, s/sp, d] -> [1, h/sp, s, d]
        sp = dist.get_world_size(ctx.sp_group)
        if heads % sp:
            raise RuntimeError(f"{heads} attention heads do not divide over ulysses_size={sp}")
        if kv_heads % sp:  # too few KV heads to split: send them repeated
            key, value = _repeat_kv(key, heads // kv_heads), _repeat_kv(value, heads // kv_heads)
        query, key, value = (all_to_all(t, ctx.sp_group, 1, 2) for t in (query, key, value))
    # each rank's query heads map onto its own KV heads (GQA groups stay whole)
    key = _repeat_kv(key, query.shape[1] // key.shape[1])
    value = _repeat_kv(value, query.shape[1] // value.shape[1])
    if query.shape[2] != ctx.total:
        raise RuntimeError(f"packed row has {query.shape[2]} tokens, its spans say {ctx.total}")
    dropout = dropout if module.training else 0.0
    if ctx.kernel == "grouped_sdpa" or (dropout and ctx.kernel == "torch_varlen"):
        out = attend_spans(query, key, value, ctx.spans, dropout, scaling)
    else:  # one call for the whole row
        kernel = VARLEN_KERNELS[ctx.kernel]
        out = attend_varlen(query, key, value, ctx.layout(query.device), kernel, dropout, scaling)
    if ctx.sp_group is not None:  # back to [1, h, s/sp, d]
        out = all_to_all(out, ctx.sp_group, 2, 1)
    return out.transpose(1, 2).contiguous(), None


#: documents whose lengths differ by at most this factor (or by SLACK tokens) share one call
GROUP_RATIO, SLACK = 1.25, 8


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Document indices grouped by similar length (padding waste bounded by GROUP_RATIO)."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[i] <= max(lengths[groups[-1][0]] * GROUP_RATIO,
                                         lengths[groups[-1][0]] + SLACK):  # fmt: skip
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
            q, k, v = (t[0, :, a : a + g * n].unflatten(1, (g, n)).transpose(0, 1)
                       for t in (query, key, value))  # fmt: skip
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
    index = [torch.arange(p.start, p.stop, device=device) if isinstance(p, range) else p
             for p in positions]  # fmt: skip
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


AttentionInterface.register(NAME, varlen_attention)
