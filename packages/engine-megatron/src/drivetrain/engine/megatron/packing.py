"""A micro-batch as one packed token row for Megatron's ``GPTModel``.

Samples go back to back with position ids restarting at 0; attention stays inside each sample
(:class:`drivetrain.engine.megatron.attention.DocumentAttention` reads the samples' offsets
where megatron carries the mask: no ``[T, T]`` mask is built). The row is padded to a multiple
of the tensor-parallel size for sequence parallel. Outputs come back
aligned with ``input_ids`` (position ``t``: about token ``t``, 0 at each sample's first token)
in the micro-batch's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from drivetrain.api import Batch
from drivetrain.api.columns import INPUT_IDS
from drivetrain.engine_core import flat_column


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention_mask: torch.Tensor  # [documents + 1] int64 on the host: the offsets, padding last
    targets: torch.Tensor  # [T] the next token after each position (0 where there is none)
    offsets: tuple[int, ...]  # sample offsets, then the padding tail's
    num_tokens: int  # real tokens


def pack_row(
    batch: Batch, device: torch.device, multiple: int = 1, *, length: int | None = None
) -> PackedRow:
    """``length``: pad the row to exactly that many tokens (at least the real tokens rounded
    up to ``multiple``); default: the real tokens rounded up to ``multiple``."""
    ids = flat_column(batch, INPUT_IDS).to(device=device, dtype=torch.long)
    lens = [n for n in batch.seq_lens if n]
    real = sum(lens)
    pad = (-real) % multiple if real else multiple
    if length is not None:
        if length < real + pad:
            raise ValueError(f"row length {length} < {real + pad} tokens of the micro-batch")
        pad = length - real
    if pad:
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lens.append(pad)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    offsets = tuple(accumulate(lens, initial=0))
    targets = torch.cat([ids[1:], ids.new_zeros(1)])
    documents = torch.tensor(offsets, dtype=torch.long)  # host: read per layer without a sync
    return PackedRow(ids[None], positions[None], documents, targets, offsets, real)


def align_to_inputs(next_values: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Values per position about the *next* token ``[T]`` -> values per token
    (``out[t] = next_values[t-1]``), 0 at every sample's first token; real tokens only."""
    shifted = torch.cat([next_values.new_zeros(1), next_values[:-1]])[: row.num_tokens]
    starts = torch.tensor(row.offsets[:-1], device=shifted.device)
    keep = torch.ones_like(shifted)
    keep[starts[starts < row.num_tokens]] = 0
    return shifted * keep
