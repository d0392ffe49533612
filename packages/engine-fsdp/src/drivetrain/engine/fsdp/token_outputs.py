"""Per-token log-probs and entropy from hidden states, a chunk of tokens at a time.

Full-vocabulary logits exist for at most ``chunk`` tokens at once, in forward *and* backward:
when there are several chunks, each runs under activation checkpointing, so its logits are
recomputed during backward instead of being kept.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _chunk_outputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    linear: Linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits = logits / temperature
    # one fused log_softmax (forward and backward) is far cheaper on CPU than logsumexp's
    # separate max/sub/exp passes over the [tokens, vocab] block
    logp = torch.log_softmax(logits, dim=-1)
    log_probs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if want_entropy else torch.zeros_like(log_probs)
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
    linear: Linear = F.linear,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For hidden states ``[T, H]`` and the tokens they predict ``[T]``: ``log p(target)`` and
    the entropy of the predictive distribution at ``temperature``, both ``[T]`` float32.
    ``linear``: the head's product (``exact_linear`` under ``numerics=exact``)."""
    log_probs, entropies = [], []
    # one chunk holds no more logits than the bound anyway: recomputing it would only cost time
    grad = torch.is_grad_enabled() and hidden.shape[0] > chunk
    for start in range(0, hidden.shape[0], chunk):
        args = (hidden[start : start + chunk], weight, bias, targets[start : start + chunk])
        if grad:  # keep no logits for backward: recompute this chunk's there
            lp, ent = checkpoint(
                _chunk_outputs, *args, temperature, want_entropy, linear, use_reentrant=False
            )
        else:
            lp, ent = _chunk_outputs(*args, temperature, want_entropy, linear)
        log_probs.append(lp)
        entropies.append(ent)
    if not log_probs:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(log_probs), torch.cat(entropies)
