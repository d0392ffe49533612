"""Ulysses sequence parallelism: each rank of a sequence-parallel group holds a contiguous slice
of the packed token row; attention trades the sequence split for a head split with one
all-to-all before and one after. Autograd-aware collectives live here."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in torch.tensor_split(x, size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
    ) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int
) -> torch.Tensor:
    """Split ``scatter_dim`` across the group, concatenate what arrives along ``gather_dim``."""
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0. Every rank then computes the *same* loss on the full tensor, so
    the gradient of its own slice is simply its slice of the incoming gradient (no sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.length = rank, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.rank * ctx.length
        return grad[start : start + ctx.length].contiguous(), None


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _GatherSequence.apply(x, group)


def local_slice(x: torch.Tensor, group: dist.ProcessGroup | None, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous share of ``x`` along ``dim`` (length divisible by the group)."""
    if group is None:
        return x
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return torch.tensor_split(x, size, dim=dim)[rank]
