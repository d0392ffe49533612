"""Full (tensor-parallel-local) parameters from Megatron-FSDP's data-parallel shards.

Megatron-FSDP stores each parameter as a DTensor whose local part is a contiguous block of
rows (dim 0) of the tensor-parallel-local parameter, in data-parallel rank order; blocks are
uneven (a rank may hold 65 rows of 128, or none of a small vector). ``DTensor.full_tensor()``
assumes even shards and fails on gloo, so rows are gathered here with a plain ``all_gather``
of blocks padded to the longest one (gloo and NCCL alike), then trimmed and joined.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def gather_rows(local: torch.Tensor, group: Any) -> torch.Tensor:
    """The row blocks of every rank of ``group``, joined in rank order (collective)."""
    size = dist.get_world_size(group)
    rows = torch.tensor([local.shape[0]], dtype=torch.long, device=local.device)
    counts = [torch.empty_like(rows) for _ in range(size)]
    dist.all_gather(counts, rows, group=group)
    lengths = [int(c) for c in counts]
    padded = local.new_zeros((max(lengths), *local.shape[1:]))
    padded[: local.shape[0]] = local
    blocks = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(blocks, padded.contiguous(), group=group)
    return torch.cat([block[:n] for block, n in zip(blocks, lengths, strict=True)])


class GatheredParams(Mapping[str, torch.Tensor]):
    """Parameters by name (a chunk's, or its optimizer's main weights); each lookup gathers
    that parameter from its data-parallel shards (a collective: every rank of the stage looks
    up the same names in the same order) and casts it to ``dtype`` (shards may be fp32 main
    weights of a bf16 model)."""

    def __init__(self, params: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.params = params
        self.dtype = dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        param = self.params[name]
        if not isinstance(param, DTensor):
            return param.detach().to(self.dtype)
        local = param.to_local().detach()
        dp = param.device_mesh.mesh_dim_names.index("dp")
        if not isinstance(param.placements[dp], Shard):  # replicated over DP (no_shard)
            return local.to(self.dtype)
        return gather_rows(local, param.device_mesh.get_group("dp")).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)
