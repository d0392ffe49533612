"""The hf rollout under ``numerics=exact``: the trainer's batch-invariant arithmetic.

Registered with transformers as the attention ``drivetrain_exact`` (and a mask function that
always builds the boolean ``[batch, 1, queries, keys]`` mask, never skips it): each query
attends over its own visible keys with :func:`~drivetrain.engine_core.exact_attention.
attend_ranges`, the function the fsdp engine's packed rows call, so a token's log-prob is the
same bits in a decode step over a left-padded cache, a prompt's prefill and the trainer's packed
row. The linears, activations and rotary tables are :func:`~drivetrain.engine_core.
exact_modules.make_exact`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from drivetrain.api.errors import ConfigError
from drivetrain.engine_core.exact_attention import attend_ranges, ranges_of_mask
from drivetrain.engine_core.exact_modules import make_exact

NAME = "drivetrain_exact"


def exact_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` ``[B, heads, Q, dim]``, ``key``/``value`` ``[B, kv_heads, K, dim]`` (the whole
    cache), ``attention_mask`` boolean ``[B or 1, 1, Q, K]`` -> ``[B, Q, heads, dim]``."""
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise RuntimeError(f"attention '{NAME}' does not implement {unsupported}")
    if dropout and module.training:
        raise RuntimeError(f"attention '{NAME}' has no dropout")
    batch, heads, queries, dim = query.shape
    keys = key.shape[2]
    if attention_mask is None:  # causal over the whole row, the queries last
        visible = torch.ones(queries, keys, dtype=torch.bool, device=query.device)
        visible = visible.tril(keys - queries)[None].expand(batch, -1, -1)
    else:
        visible = attention_mask[:, 0].expand(batch, queries, keys).bool()
    starts, counts = ranges_of_mask(visible)
    groups = heads // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B, h, L, d] -> [B * L, h, d]
        return t.transpose(1, 2).reshape(-1, heads, dim)

    scale = scaling if scaling is not None else dim**-0.5
    out = attend_ranges(rows(query), rows(key), rows(value), starts, counts, scale)
    return out.reshape(batch, queries, heads, dim), None


def _boolean_mask(*args: Any, **kwargs: Any) -> Any:
    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(NAME, exact_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, _boolean_mask)


def make_rollout_exact(model: torch.nn.Module, device: torch.device) -> None:
    """``model`` (loaded with ``attn_implementation=NAME``) on the trainer's arithmetic."""
    if device.type != "cpu":
        raise ConfigError(f"numerics=exact is proven on the CPU only; the rollout is on {device}")
    try:
        make_exact(model)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
