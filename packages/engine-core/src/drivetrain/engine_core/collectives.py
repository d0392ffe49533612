"""``torch.distributed`` behind the runtime's micro-batch driver
(:class:`~drivetrain.runtime.micro_batching.Collectives`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class TorchCollectives:
    """Reductions over the engine's whole world (``max_ints``, ``gather_texts``) and over its
    data-parallel group (``sum_over_data_parallel``; ``None``: the whole world).

    ``device``: where reduced tensors live (NCCL reduces device tensors only). A process without
    a process group is a world of one: every reduction returns its input.
    """

    def __init__(self, device: torch.device, data_parallel_group: Any = None) -> None:
        self.device = device
        self.data_parallel_group = data_parallel_group

    def _reduce(
        self, values: Sequence[float], dtype: torch.dtype, op: Any, group: Any
    ) -> list[Any]:
        tensor = torch.tensor(list(values), dtype=dtype, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(tensor, op=op, group=group)
        return tensor.tolist()

    def max_ints(self, values: Sequence[int]) -> list[int]:
        return self._reduce(values, torch.long, dist.ReduceOp.MAX, None)

    def sum_over_data_parallel(self, values: Sequence[float]) -> list[float]:
        # float64: token counts stay exact far beyond float32's 2**24
        return self._reduce(values, torch.float64, dist.ReduceOp.SUM, self.data_parallel_group)

    def gather_texts(self, text: str) -> list[str]:
        if not dist.is_initialized():
            return [text]
        # UTF-8 bytes in a tensor, not all_gather_object: nothing received is unpickled
        data = text.encode()
        width = max(self.max_ints([len(data)])[0], 1)
        mine = torch.zeros(width, dtype=torch.uint8, device=self.device)
        mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, mine)
        return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in rows]
