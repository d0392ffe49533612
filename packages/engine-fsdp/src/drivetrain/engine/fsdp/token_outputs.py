"""Per-token log-probs and entropy from hidden states, a chunk of tokens at a time.

Full-vocabulary logits exist for at most ``chunk`` tokens at once, in forward *and* backward:
each chunk runs under activation checkpointing, so its logits are recomputed during backward
instead of being kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float() / temperature
    log_norm = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm
    if want_entropy:
        entropy = log_norm - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    else:
        entropy = torch.zeros_like(log_probs)
    return log_probs, entropy


def next_token_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float,
    want_entropy: bool,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For hidden states ``[T, H]`` and the tokens they predict ``[T]``: ``log p(target)`` and
    the entropy of the predictive distribution at ``temperature``, both ``[T]`` float32."""
    log_probs, entropies = [], []
    grad = torch.is_grad_enabled()
    for start in range(0, hidden.shape[0], chunk):
        args = (hidden[start : start + chunk], weight, bias, targets[start : start + chunk])
        if grad:
            lp, ent = checkpoint(
                _chunk_outputs, *args, temperature, want_entropy, use_reentrant=False
            )
        else:
            lp, ent = _chunk_outputs(*args, temperature, want_entropy)
        log_probs.append(lp)
        entropies.append(ent)
    if not log_probs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(log_probs), torch.cat(entropies)
