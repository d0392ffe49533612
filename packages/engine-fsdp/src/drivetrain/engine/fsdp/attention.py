"""Causal attention over packed sequences, one document at a time, with optional Ulysses.

Registered with transformers as the attention implementation ``drivetrain_varlen``. Before
each forward the engine sets the packed row's sequence offsets (``cu_seqlens``, over the *full*
row) and the sequence-parallel group with :func:`set_packed_row`. The setting stays until the
next forward, because activation checkpointing re-runs attention during backward, possibly on
autograd's device thread (so a context variable would not do). Transformers builds no mask for
it; attention never crosses a sequence boundary, and costs sum(len_i^2) rather than T^2 (on CPU
looping SDPA per document measured faster than one block-diagonal mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface

from drivetrain.engine.fsdp.sequence_parallel import all_to_all

NAME = "drivetrain_varlen"


@dataclass(frozen=True)
class PackedContext:
    cu_seqlens: tuple[int, ...]
    sp_group: dist.ProcessGroup | None = None


_CURRENT: list[PackedContext] = []


def set_packed_row(cu_seqlens: tuple[int, ...], sp_group: dist.ProcessGroup | None) -> None:
    """Describe the packed row of the next forward (kept for recomputation in backward)."""
    _CURRENT[:] = [PackedContext(tuple(cu_seqlens), sp_group)]


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
    if query.shape[2] != ctx.cu_seqlens[-1]:
        raise RuntimeError(
            f"packed row has {query.shape[2]} tokens, offsets say {ctx.cu_seqlens[-1]}"
        )
    pieces = []
    for start, stop in zip(ctx.cu_seqlens, ctx.cu_seqlens[1:], strict=False):
        if stop > start:
            pieces.append(
                F.scaled_dot_product_attention(
                    query[:, :, start:stop],
                    key[:, :, start:stop],
                    value[:, :, start:stop],
                    dropout_p=dropout if module.training else 0.0,
                    is_causal=True,
                    scale=scaling,
                )
            )
    out = torch.cat(pieces, dim=2)
    if ctx.sp_group is not None:  # back to [1, h, s/sp, d]
        out = all_to_all(out, ctx.sp_group, 2, 1)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, varlen_attention)
