"""Packed-row attention for transformers models, with optional Ulysses.

Registered with transformers as the attention implementation ``drivetrain_varlen``. Before
each forward the engine describes the packed row with :func:`set_packed_row`: its spans of
queries, over the *full* row, the sequence-parallel group and the kernel. The setting stays
until the next forward, because activation checkpointing re-runs attention during backward,
possibly on autograd's device thread (so a context variable would not do). Transformers builds
no mask for it; attention never crosses a sequence boundary: the grouped SDPA path
(:mod:`drivetrain.engine_core.packed_attention`) or one variable-length kernel call per layer
(:mod:`drivetrain.engine_core.packed_kernels`, on CUDA). Spans may see a shared prefix (see
:mod:`drivetrain.engine.fsdp.prefix_sharing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from transformers import AttentionInterface

from drivetrain.engine.fsdp.sequence_parallel import all_to_all
from drivetrain.engine_core.exact_attention import Blocks, attend_blocks, blocks_of_spans
from drivetrain.engine_core.packed_attention import Span, attend_spans
from drivetrain.engine_core.packed_kernels import (
    VARLEN_KERNELS,
    VarlenLayout,
    attend_varlen,
    varlen_layout,
)

NAME = "drivetrain_varlen"
#: the kernel of ``numerics=exact``: each query over its own keys, the rollout's arithmetic
#: (:mod:`drivetrain.engine_core.exact_attention`)
EXACT = "exact"


@dataclass(frozen=True)
class PackedContext:
    spans: tuple[Span, ...]
    sp_group: dist.ProcessGroup | None = None
    kernel: str = "grouped_sdpa"  # or a name in packed_kernels.VARLEN_KERNELS, or EXACT
    #: the spans' variable-length layout per device, built by the first layer, reused by the rest
    layouts: dict[torch.device, VarlenLayout] = field(default_factory=dict, compare=False)
    #: the spans as exact attention's blocks per device (``EXACT``), likewise built once
    blocks: dict[torch.device, Blocks] = field(default_factory=dict, compare=False)

    @property
    def total(self) -> int:
        """The row's length (spans cover every position once)."""
        return sum(s.length for s in self.spans)

    def exact_blocks(self, device: torch.device) -> Blocks:
        if device not in self.blocks:
            self.blocks[device] = blocks_of_spans(self.spans, device)
        return self.blocks[device]

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
    if query.shape[2] != ctx.total:
        raise RuntimeError(f"packed row has {query.shape[2]} tokens, its spans say {ctx.total}")
    dropout = dropout if module.training else 0.0
    if ctx.kernel == EXACT:  # GQA inside, as the rollout's (the same product shapes)
        out = _attend_exact(ctx, query, key, value, dropout, scaling)
    else:
        out = _attend_packed(ctx, query, key, value, dropout, scaling)
    if ctx.sp_group is not None:  # back to [1, h, s/sp, d]
        out = all_to_all(out, ctx.sp_group, 2, 1)
    return out.transpose(1, 2).contiguous(), None


def _attend_packed(
    ctx: PackedContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    # each rank's query heads map onto its own KV heads (GQA groups stay whole)
    key = _repeat_kv(key, query.shape[1] // key.shape[1])
    value = _repeat_kv(value, query.shape[1] // value.shape[1])
    if ctx.kernel == "grouped_sdpa" or (dropout and ctx.kernel == "torch_varlen"):
        out = attend_spans(query, key, value, ctx.spans, dropout, scaling)
    else:  # one call for the whole row
        kernel = VARLEN_KERNELS[ctx.kernel]
        out = attend_varlen(query, key, value, ctx.layout(query.device), kernel, dropout, scaling)
    return out


def _attend_exact(
    ctx: PackedContext,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    if dropout:
        raise RuntimeError("numerics=exact has no attention dropout: set the model's to 0")
    blocks = ctx.exact_blocks(query.device)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [1, T, h, d] views
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return attend_blocks(q, k, v, blocks, scale).transpose(0, 1).unsqueeze(0)


AttentionInterface.register(NAME, varlen_attention)
