"""Context parallel (CP): each sequence split over ``CP`` ranks, load-balanced for causal
attention, and put back together afterwards.

Every sequence of a packed micro-batch is padded to a multiple of ``2 * CP`` tokens and cut into
``2 * CP`` equal chunks; CP rank ``r`` holds chunks ``r`` and ``2*CP - 1 - r`` of *every*
sequence (an early, cheap chunk with a late, expensive one: each rank does the same causal
attention work). This is the layout TransformerEngine's ``thd`` context-parallel attention
expects (``PackedSeqParams`` with the padded ``cu_seqlens``; rotary embeddings are sliced the
same way inside TE/megatron).

Targets (the next token) are taken on the whole row *before* the split, so a rank's last token
of a chunk knows its successor held by another rank. Per-token outputs (log-probs, entropy,
values) are all-gathered over the CP group with a backward that keeps only this rank's slice
of the gradient, then put back in the original order: every CP rank computes the loss on the
whole micro-batch, each rank's parameter gradients cover its own tokens, and megatron's DDP
sums them over the data-parallel x context-parallel group. The global token count comes from the
data-parallel group alone (CP ranks share their data), so the api's loss normalisation does not
depend on CP.

megatron-core's own attention (``DotProductAttention``, the only one without TransformerEngine)
refuses CP > 1, so CP needs TransformerEngine and CUDA; the index logic here is plain torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist


def context_parallel_kwargs(on_cpu: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields for CP > 1, after checking it can run here."""
    check_context_parallel_available(on_cpu)
    return {"cp_comm_type": "p2p"}  # ring exchange of K/V chunks (TE's default CP algorithm)


def check_context_parallel_available(on_cpu: bool) -> None:
    if on_cpu:
        raise ValueError(
            "context_parallel > 1 needs TransformerEngine's attention, which is CUDA-only: "
            "megatron-core's local DotProductAttention refuses context parallelism, so CP cannot "
            "run on CPU (use context_parallel=1 there)"
        )
    try:
        import transformer_engine  # noqa: F401
    except ImportError as error:
        raise ValueError(
            "context_parallel > 1 needs TransformerEngine (pip install transformer-engine[pytorch])"
            f": megatron-core's local attention refuses context parallelism ({error})"
        ) from error


def padded_lengths(lengths: list[int], cp: int, multiple: int = 1) -> list[int]:
    """Each sequence length rounded up to a multiple of ``2 * cp * multiple`` (``multiple``: the
    TP size under sequence parallel, so every rank's share also splits over TP)."""
    align = 2 * cp * multiple
    return [-(-n // align) * align for n in lengths]


def chunk_index(padded: list[int], cp: int, rank: int) -> torch.Tensor:
    """Positions of the padded packed row (sequences back to back, each of its ``padded``
    length) that CP rank ``rank`` holds: chunks ``rank`` and ``2*cp-1-rank`` of each sequence,
    sequence after sequence."""
    parts = []
    offset = 0
    for length in padded:
        if length % (2 * cp):
            raise ValueError(f"sequence length {length} is not a multiple of 2*cp = {2 * cp}")
        size = length // (2 * cp)
        for chunk in (rank, 2 * cp - 1 - rank):
            start = offset + chunk * size
            parts.append(torch.arange(start, start + size))
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split(row: torch.Tensor, padded: list[int], cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """This rank's part of a padded packed row, along ``dim``."""
    index = chunk_index(padded, cp, rank).to(row.device)
    return row.index_select(dim, index)


def unsplit(parts: list[torch.Tensor], padded: list[int], dim: int = 0) -> torch.Tensor:
    """The padded packed row from every CP rank's part (rank order), original token order."""
    cp = len(parts)
    order = torch.cat([chunk_index(padded, cp, r) for r in range(cp)]).to(parts[0].device)
    stacked = torch.cat(parts, dim=dim)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return stacked.index_select(dim, inverse)


def real_positions(lengths: list[int], padded: list[int]) -> torch.Tensor:
    """Positions of the real tokens in the padded row (drops each sequence's padding tail)."""
    parts, offset = [], 0
    for real, length in zip(lengths, padded, strict=True):
        parts.append(torch.arange(offset, offset + real))
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


class _GatherKeepLocalGrad(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward returns this rank's slice of the
    incoming gradient (not a sum over ranks: each rank computes the same loss from the gathered
    tensor, so summing would count every token's gradient ``CP`` times)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any) -> torch.Tensor:
        size = dist.get_world_size(group)
        ctx.rank, ctx.size = dist.get_rank(group), size
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.size)[ctx.rank].contiguous(), None


def gather_outputs(
    local: torch.Tensor, lengths: list[int], padded: list[int], group: Any
) -> torch.Tensor:
    """Per-token values of this CP rank's tokens ``[T/cp]`` -> the real tokens of the whole
    packed row in original order ``[sum(lengths)]``, differentiable (see
    :class:`_GatherKeepLocalGrad`)."""
    size = dist.get_world_size(group)
    gathered = _GatherKeepLocalGrad.apply(local, group)
    row = unsplit(list(gathered.chunk(size)), padded)
    return row.index_select(0, real_positions(lengths, padded).to(row.device))


@dataclass(frozen=True)
class ContextParallelRow:
    """One micro-batch as this CP rank's share of a packed ``thd`` row (TransformerEngine's
    packed layout: no attention mask, sequence boundaries in ``packed_seq_params``)."""

    input_ids: torch.Tensor  # [1, T/cp]
    position_ids: torch.Tensor  # [1, T/cp]
    targets: torch.Tensor  # [T/cp] the next token of each held position (0 where none)
    packed_seq_params: Any  # megatron PackedSeqParams over the whole (padded) row
    lengths: tuple[int, ...]  # real tokens per sequence
    padded: tuple[int, ...]  # per sequence, padded to a multiple of 2*cp(*tp under SP)
    offsets: tuple[int, ...]  # sample offsets of the real tokens back to back (for alignment)
    num_tokens: int
    attention_mask: None = None


def pack_row_cp(
    ids: torch.Tensor, lengths: list[int], *, cp: int, rank: int, multiple: int = 1
) -> ContextParallelRow:
    """``ids``: the micro-batch's real tokens back to back; ``lengths``: tokens per sample."""
    from megatron.core.packed_seq_params import PackedSeqParams

    device = ids.device
    lengths = [n for n in lengths if n] or [0]
    padded = padded_lengths([max(n, 1) for n in lengths], cp, multiple)
    row = torch.zeros(sum(padded), dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in padded])
    offset = 0
    for real, length, start in zip(lengths, padded, accumulate(lengths, initial=0), strict=False):
        row[offset : offset + real] = ids[start : start + real]
        offset += length
    targets = torch.cat([row[1:], row.new_zeros(1)])
    cu = torch.tensor(list(accumulate(padded, initial=0)), dtype=torch.int32, device=device)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=cu,
        cu_seqlens_kv_padded=cu,
        max_seqlen_q=max(padded),
        max_seqlen_kv=max(padded),
    )
    return ContextParallelRow(
        input_ids=split(row, padded, cp, rank)[None],
        position_ids=split(positions, padded, cp, rank)[None],
        targets=split(targets, padded, cp, rank),
        packed_seq_params=params,
        lengths=tuple(lengths),
        padded=tuple(padded),
        offsets=tuple(accumulate(lengths, initial=0)),
        num_tokens=sum(lengths),
    )
