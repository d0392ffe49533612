"""Per-token log-probs and entropy from vocab-parallel logits (each tensor-parallel rank holds
a slice of the vocabulary), without gathering full-vocabulary logits anywhere.

Sums over the vocabulary are all-reduced with megatron's ``reduce_from_tensor_model_parallel``
(forward all-reduce, backward identity: each rank's gradient belongs to its own slice). Columns
past the model's real vocabulary (our padding to a multiple of 128 * TP) are masked out.

The fp32 work runs a chunk of tokens at a time (``CHUNK_BYTES`` of fp32 logits per chunk),
each chunk under activation checkpointing when there are several: a 16k-token row of a 32k
vocabulary would otherwise hold 2 GiB fp32 tensors, several of them alive for backward. Every
tensor-parallel rank runs the same chunks in the same order, so the collectives inside line up
in forward and in the recomputation.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from torch.utils.checkpoint import checkpoint

#: fp32 logits of one chunk of tokens at most (fsdp's ``logits_chunk_mib`` default)
CHUNK_BYTES = 256 << 20


def vocab_parallel_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits ``[T, V/tp]`` (this rank's vocabulary slice) and targets ``[T]``: log p(target)
    and the entropy of the predictive distribution at ``temperature``, both ``[T]`` float32 and
    identical on every tensor-parallel rank."""
    chunk = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
    grad = torch.is_grad_enabled() and logits.shape[0] > chunk
    parts = []
    for start in range(0, max(logits.shape[0], 1), chunk):
        args = (logits[start : start + chunk], targets[start : start + chunk])
        if grad:  # keep no fp32 chunk for backward: recompute it there
            parts.append(
                checkpoint(
                    _chunk_outputs,
                    *args,
                    vocab_size,
                    temperature,
                    want_entropy,
                    use_reentrant=False,
                )
            )
        else:
            parts.append(_chunk_outputs(*args, vocab_size, temperature, want_entropy))
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _chunk_outputs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rank = parallel_state.get_tensor_model_parallel_rank()
    local = logits.shape[-1]
    start = rank * local
    logits = logits.float() / temperature
    columns = torch.arange(start, start + local, device=logits.device)
    if start + local > vocab_size:  # padded columns are not tokens
        logits = logits.masked_fill(columns >= vocab_size, float("-inf"))
    peak = logits.detach().max(dim=-1).values
    torch.distributed.all_reduce(
        peak,
        op=torch.distributed.ReduceOp.MAX,
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    shifted = logits - peak[:, None]
    exp = shifted.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    owned = (targets >= start) & (targets < start + local)
    picked = shifted.gather(-1, (targets - start).clamp(0, local - 1)[:, None])[:, 0]
    target_logit = reduce_from_tensor_model_parallel_region(torch.where(owned, picked, 0.0))
    log_total = total.log()
    log_probs = target_logit - log_total
    if not want_entropy:
        return log_probs, torch.zeros_like(log_probs)
    finite = torch.where(exp > 0, shifted, 0.0)  # -inf * 0 would be nan
    weighted = reduce_from_tensor_model_parallel_region((exp * finite).sum(dim=-1))
    entropy = log_total - weighted / total
    return log_probs, entropy
