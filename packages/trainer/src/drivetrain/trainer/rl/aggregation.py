"""How per-token losses become one number, normalised by the *global* counts of the
mini-batch (all micro-batches, all data-parallel ranks) so the result does not depend on how
an engine cut it into micro-batches.

- ``token-mean``: every response token weighs the same (long answers weigh more);
- ``seq-mean-token-sum``: sum over a sequence's tokens, mean over sequences (Dr. GRPO's
  unbiased form when paired with a fixed length normaliser);
- ``seq-mean-token-mean``: mean within a sequence, then mean over sequences (the original
  GRPO paper);
- ``seq-mean-token-sum-norm``: sum over all tokens divided by sequences x a fixed length
  (``sampling.max_new_tokens``): Dr. GRPO's constant normaliser (TRL ``loss_type="dr_grpo"``,
  verl ``loss_agg_mode="seq-mean-token-sum-norm"``).

Token tensors are either padded ``[b, T]`` or packed ``[tokens]`` (then ``seq_lens`` says where
each sequence ends).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from drivetrain.trainer.sequences import sequence_sums

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def sequence_means(
    values: torch.Tensor, mask: torch.Tensor, seq_lens: Sequence[int]
) -> torch.Tensor:
    """Per-sequence means of ``values`` over the tokens where ``mask`` is 1."""
    counts = sequence_sums(mask, seq_lens).clamp(min=1)
    return sequence_sums(values * mask, seq_lens) / counts


def expand_sequences(
    per_seq: torch.Tensor, like: torch.Tensor, seq_lens: Sequence[int]
) -> torch.Tensor:
    """One value per sequence put on each of its tokens, laid out like ``like``."""
    if like.dim() == 2:
        return per_seq[:, None].expand_as(like)
    lengths = torch.as_tensor(list(seq_lens), device=like.device)
    return torch.repeat_interleave(per_seq, lengths)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    seq_lens: Sequence[int],
    global_tokens: int,
    global_sequences: int,
    max_length: int = 0,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss (shares sum to the mini-batch value).
    ``max_length`` is the fixed normaliser of ``seq-mean-token-sum-norm``."""
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / max(global_tokens, 1)
    if mode == "seq-mean-token-sum-norm":
        if max_length < 1:
            raise ValueError("seq-mean-token-sum-norm needs max_length >= 1")
        return masked.sum() / (max(global_sequences, 1) * max_length)
    sums = sequence_sums(masked, seq_lens)
    if mode == "seq-mean-token-sum":
        return sums.sum() / max(global_sequences, 1)
    if mode == "seq-mean-token-mean":
        counts = sequence_sums(mask, seq_lens).clamp(min=1)
        return (sums / counts).sum() / max(global_sequences, 1)
    raise ValueError(f"unknown loss aggregation {mode!r}; known: {', '.join(AGGREGATIONS)}")
