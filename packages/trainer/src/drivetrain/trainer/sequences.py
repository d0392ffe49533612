"""Per-sequence reductions of token tensors, padded ``[b, T]`` or packed ``[tokens]``: what
the RL aggregations and the preference losses share."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sequence_sums(values: torch.Tensor, seq_lens: Sequence[int]) -> torch.Tensor:
    """Per-sequence sums of a padded ``[b, T]`` or packed ``[tokens]`` tensor."""
    if values.dim() == 2:
        return values.sum(dim=-1)
    lengths = torch.as_tensor(list(seq_lens), device=values.device)
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths)
    return torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add(
        0, ids, values
    )
