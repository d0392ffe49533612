"""Between the api's batches and the packed token row the model computes on.

Whatever the input layout, the engine computes on one packed row per micro-batch: tokens of all
samples back to back, position ids restarting at 0 per sample, sequence offsets for attention.
Outputs are aligned with ``input_ids`` (position ``t``: about token ``t``; 0 at each sample's
first token) and returned in the micro-batch's own layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from drivetrain.api import Batch, Layout
from drivetrain.api.columns import INPUT_IDS


@dataclass(frozen=True)
class PackedRow:
    input_ids: torch.Tensor  # [T] (T padded to a multiple of the sequence-parallel size)
    position_ids: torch.Tensor  # [T]
    targets: torch.Tensor  # [T]: the next token after each position (0 where there is none)
    cu_seqlens: tuple[int, ...]  # offsets of the real samples, then of the padding tail
    num_tokens: int  # real tokens (without the padding tail)


def flat_column(batch: Batch, name: str) -> torch.Tensor:
    """A token column as one flat tensor of the samples' real tokens."""
    value = batch[name]
    if batch.layout is Layout.PACKED:
        return value
    return (
        torch.cat([value[i, :n] for i, n in enumerate(batch.seq_lens)])
        if len(batch)
        else value[:0, 0]
    )


def pack(batch: Batch, device: torch.device, multiple: int = 1) -> PackedRow:
    ids = flat_column(batch, INPUT_IDS).to(device=device, dtype=torch.long)
    lens = list(batch.seq_lens)
    real = sum(lens)
    pad = (-real) % multiple if real else multiple
    if pad:  # a dummy tail sample so the row splits evenly over sequence-parallel ranks
        ids = torch.cat([ids, ids.new_zeros(pad)])
        lens.append(pad)
    positions = torch.cat([torch.arange(n, device=device) for n in lens if n])
    targets = torch.cat([ids[1:], ids.new_zeros(1)])
    offsets = tuple(accumulate(lens, initial=0))
    return PackedRow(ids, positions, targets, offsets, real)


def align_to_inputs(next_values: torch.Tensor, row: PackedRow) -> torch.Tensor:
    """Values computed per position for the *next* token ``[T]`` -> values per token
    (``out[t] = next_values[t-1]``), 0 at every sample's first token; real tokens only."""
    shifted = torch.cat([next_values.new_zeros(1), next_values[:-1]])[: row.num_tokens]
    starts = torch.tensor(row.cu_seqlens[:-1], device=shifted.device)
    starts = starts[starts < row.num_tokens]
    mask = torch.ones_like(shifted)
    mask[starts] = 0
    return shifted * mask


def to_layout(flat: torch.Tensor, batch: Batch) -> torch.Tensor:
    """A flat per-token tensor in ``batch``'s layout (padded: right-padded to the width of
    ``batch["input_ids"]``)."""
    if batch.layout is Layout.PACKED:
        return flat
    width = batch[INPUT_IDS].shape[1]
    out = flat.new_zeros(len(batch), width)
    mask = (
        torch.arange(width, device=flat.device)[None, :]
        < torch.tensor(batch.seq_lens, device=flat.device)[:, None]
    )
    out[mask] = flat
    return out
