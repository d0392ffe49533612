"""Per-token tensors between a batch's layout and the flat token order engines compute in."""

from __future__ import annotations

import torch

from drivetrain.api import Batch, Layout
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK


def flat_column(batch: Batch, name: str) -> torch.Tensor:
    """A token column as one flat tensor of the samples' real tokens (padding dropped)."""
    value = batch[name]
    if batch.layout is Layout.PACKED:
        return value
    if not len(batch):
        return value[:0, 0]
    return torch.cat([value[i, :n] for i, n in enumerate(batch.seq_lens)])


def to_layout(flat: torch.Tensor, batch: Batch, fill: float = 0) -> torch.Tensor:
    """A flat per-token tensor (``[tokens, ...]``) in ``batch``'s layout (padded:
    right-padded with ``fill`` to the width of ``batch["input_ids"]``)."""
    if batch.layout is Layout.PACKED:
        return flat
    width = batch[INPUT_IDS].shape[1]
    out = flat.new_full((len(batch), width, *flat.shape[1:]), fill)
    lens = torch.tensor(batch.seq_lens, device=flat.device)
    out[torch.arange(width, device=flat.device)[None, :] < lens[:, None]] = flat
    return out


def on_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with its tensor columns on ``device``: the loss function combines them with
    the model's outputs there."""
    moved = {
        name: value.to(device)
        for name, value in batch.columns.items()
        if isinstance(value, torch.Tensor) and value.device != device
    }
    return batch.with_columns(**moved) if moved else batch


def loss_free_batch(tokens: int, device: torch.device) -> Batch:
    """One sample of ``tokens`` zero tokens with ``loss_mask`` 0: what a rank runs for an
    empty micro-batch so its collectives line up with its peers'."""
    return Batch.from_columns(
        {
            INPUT_IDS: torch.zeros(1, tokens, dtype=torch.long, device=device),
            LOSS_MASK: torch.zeros(1, tokens, dtype=torch.float32, device=device),
        },
        seq_lens=[tokens],
    )
