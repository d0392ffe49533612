"""Context parallel in the planner: TransformerEngine's ring attention (CUDA-only, and absent
here: megatron's ``TEDotProductAttention`` is a placeholder without it) stood in by what holds
the same memory to first order: one variable-length attention over the rank's ``T / cp`` tokens
(it keeps q, k, v, the output and the log-sum-exp). Not modelled: the ring's in-flight K/V
receive buffers (two ``[T / cp, kv_heads, d]`` a layer, transient) and TE's fp32 corrections."""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
from megatron.core.transformer.module import MegatronModule


class RingAttentionStandIn(MegatronModule):
    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, *a: Any, **k: Any):
        super().__init__(config=config)

    def forward(self, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.nn.attention.varlen import varlen_attn

        tokens = query.shape[0]  # thd: query [t, heads, d], key/value [t, groups, d]
        bounds = torch.tensor([0, tokens], dtype=torch.int32)
        out = varlen_attn(
            query.contiguous(), key.contiguous(), value.contiguous(), bounds, bounds, tokens,
            tokens, window_size=(-1, 0), enable_gqa=query.shape[1] != key.shape[1],
        )  # fmt: skip
        return out.reshape(tokens, -1)


def context_parallel_patches() -> list[Any]:
    import megatron.core.extensions.transformer_engine as te

    from drivetrain.engine.megatron import model

    return [
        mock.patch.object(model, "context_parallel_kwargs", lambda on_cpu: {"cp_comm_type": "p2p"}),
        mock.patch.object(te, "TEDotProductAttention", RingAttentionStandIn),
    ]
