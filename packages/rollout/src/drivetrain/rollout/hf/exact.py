"""The hf rollout under ``numerics=exact``: the trainer's batch-invariant arithmetic.

Registered with transformers as the attention ``drivetrain_exact`` (and a mask function that
always builds the boolean ``[batch, 1, queries, keys]`` mask, never skips it): each cache row
is a block of :func:`~drivetrain.engine_core.exact_attention.attend_blocks`, the function the
fsdp engine's packed rows call, so a token's log-prob is the same bits in a decode step over a
left-padded cache, a prompt's prefill and the trainer's packed row. The linears, activations
and rotary tables are :func:`~drivetrain.engine_core.exact_modules.make_exact`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from drivetrain.api.errors import ConfigError
from drivetrain.engine_core.exact_attention import Blocks, attend_blocks, blocks_of_mask
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
    blocks = _blocks(visible, attention_mask)
    scale = scaling if scaling is not None else dim**-0.5
    views = (t.transpose(1, 2) for t in (query, key, value))  # [B, L, heads, dim], no copy
    out = attend_blocks(*views, blocks, scale)
    return out.reshape(batch, queries, heads, dim), None


#: the last mask's blocks: every layer of one forward gets the same mask object
_last: list[tuple[torch.Tensor | None, Blocks]] = []


def _blocks(visible: torch.Tensor, mask: torch.Tensor | None) -> Blocks:
    last = _last[0] if _last else None  # one read: another rollout may replace it
    if mask is not None and last is not None and last[0] is mask:
        return last[1]
    blocks = blocks_of_mask(visible)
    _last[:] = [(mask, blocks)]
    return blocks


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
