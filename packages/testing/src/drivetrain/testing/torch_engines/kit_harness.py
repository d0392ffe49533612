"""The torch half of a conformance-kit harness (:class:`drivetrain.testing.harness.
EngineHarness`), for any torch engine: an engine's harness inherits :class:`TorchHarness` and
adds what is its own (``make_engine``, ``reference_weights``, its tolerances)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api import Batch
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK


def padded_batch(sequences: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]]) -> Batch:
    """A padded batch of long ``input_ids`` and float32 ``loss_mask`` (the column contract)."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.float32)
    for i, (s, m) in enumerate(zip(sequences, loss_mask, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return Batch.from_columns(
        {INPUT_IDS: ids, LOSS_MASK: mask}, seq_lens=[len(s) for s in sequences]
    )


class TorchHarness:
    """Batches of torch tensors, values read back as lists, dtypes and devices by name, and
    the process group's ``all_gather_object`` (the kit's collective: the engine's process
    group must exist, as it does once the first engine is made)."""

    def make_batch(
        self, sequences: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]]
    ) -> Batch:
        return padded_batch(sequences, loss_mask)

    def to_list(self, value: Any) -> Any:
        return value.tolist() if isinstance(value, torch.Tensor) else value

    def dtype_of(self, value: Any) -> str:
        return str(value.dtype).removeprefix("torch.")

    def device_of(self, value: Any) -> str:
        return str(value.device)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
