"""megatron-core's core attention over a packed row, one document at a time.

Without TransformerEngine, megatron-core's only core attention (``DotProductAttention``)
computes every score of the row and masks with a dense ``[T, T]`` mask: on the first H100 run
one packed 16k-token micro-batch of a 1B model asked for a 16 GiB score tensor and ran out of
memory. :class:`DocumentAttention` takes its place in the local layer spec and attends within
each document only, through the kernels fsdp uses (:mod:`drivetrain.engine_core`): on CUDA one
variable-length kernel call per layer, elsewhere the grouped SDPA path. No score matrix over
the row and no mask exist.

The row's document offsets travel where megatron carries the mask (``attention_mask``: an
int64 tensor on the host, ``packing.pack_row``), so they reach every layer of every pipeline
stage, and activation recomputation replays the same ones.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention

from drivetrain.engine_core.packed_attention import attend_spans, plain_spans
from drivetrain.engine_core.packed_kernels import VARLEN_KERNELS, attend_varlen, varlen_layout


class DocumentAttention(DotProductAttention):
    """``DotProductAttention``'s heads, scale and dropout; attention per document.

    ``kernel``: ``grouped_sdpa`` or a name in ``packed_kernels.VARLEN_KERNELS`` (the engine's
    ``choose_kernel``, given through the layer spec's params)."""

    def __init__(self, *args: Any, kernel: str = "grouped_sdpa", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.config.softmax_type != "vanilla" or self.scale_mask_softmax.window_size:
            raise ValueError("document attention supports plain softmax without a window")
        self.kernel = kernel

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``query`` ``[T, b, heads, dim]``, ``key``/``value`` ``[T, b, groups, dim]``;
        ``attention_mask``: a packed row's document offsets ``[documents + 1]`` (``b`` = 1), or
        ``None``: each of the ``b`` rows is one causal sequence. Returns ``[T, b, heads * dim]``."""
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("document attention takes neither an attention bias nor thd params")
        if attention_mask is not None and (attention_mask.dim() != 1 or query.shape[1] != 1):
            raise ValueError("document attention takes one packed row and its document offsets")
        repeat = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=2)
            value = value.repeat_interleave(repeat, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, T, dim]
        dropout = self.attention_dropout.p if self.training else 0.0
        # as megatron's: without sequence parallel, dropout draws from the TP-rank's own stream
        rng = tensor_parallel.get_cuda_rng_tracker().fork
        with rng() if dropout and not self.config.sequence_parallel else nullcontext():
            if attention_mask is None:  # whole rows: one causal call
                out = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale
                )
            elif self.kernel == "grouped_sdpa" or (dropout and self.kernel == "torch_varlen"):
                spans = plain_spans(attention_mask.tolist())
                out = attend_spans(q, k, v, spans, dropout, self.softmax_scale)
            else:
                kernel = VARLEN_KERNELS[self.kernel]
                layout = varlen_layout(plain_spans(attention_mask.tolist()), q.device)
                out = attend_varlen(q, k, v, layout, kernel, dropout, self.softmax_scale)
        # [b, heads, T, dim] -> [T, b, heads * dim]
        return out.permute(2, 0, 1, 3).reshape(*query.shape[:2], self.hidden_size_per_partition)
