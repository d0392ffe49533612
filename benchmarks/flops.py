"""Useful-token efficiency: the model FLOPs a step's real tokens need, and this machine's
matmul peak, so every training benchmark can report useful tokens/s and MFU.

Model FLOPs count what the model needs for the real (non-pad) tokens, never what an
implementation spends on padding or recomputation: ``6 * N`` per token for the matmul
parameters ``N`` (every ``nn.Linear`` weight, the LM head included when it is tied to the
embedding; an embedding lookup is no matmul), plus causal attention: a document of ``n``
tokens costs ``6 * A * n * (n + 1)`` per layer forward and backward (``A`` = heads x head
size; ``QK^T`` and ``AV`` each ``A * n * (n + 1)`` FLOPs over the causal triangle, times 3
for the backward).
Padded and packed runs of the same documents thus get the same FLOPs, and the faster one the
higher MFU.

The peak is measured in the same run (a ``(1024 x 2048) @ (2048 x 2048)`` matmul in the
benchmark's dtype and thread count), the best of several tries: a CPU MFU, comparable across
configurations measured together, not across machines.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch


def matmul_peak(dtype: torch.dtype = torch.float32, device: str = "cpu", tries: int = 5) -> float:
    """FLOP/s of a large matmul here: the best of ``tries`` timings of 0.1 s or more. On an
    accelerator an 8k x 8k matmul in batches of 10, synchronized once per batch: a 1k x 2k one
    synchronized after each call timed the launch and the wait (276 TFLOP/s on an H200 whose
    8k matmul runs near 800)."""
    m, k, n = (1024, 2048, 2048) if device == "cpu" else (8192, 8192, 8192)
    batch = 1 if device == "cpu" else 10
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    flops = 2 * m * k * n
    a @ b  # first-call set-up
    if device != "cpu":
        torch.cuda.synchronize()
    best = 0.0
    for _ in range(tries):
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(batch):
                a @ b
            count += batch
            if device != "cpu":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if elapsed >= 0.1:
                break
        best = max(best, flops * count / elapsed)
    return best


def matmul_params(model: torch.nn.Module) -> int:
    """Weights every token multiplies by: each ``nn.Linear`` module's (a tied LM head counts)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def attention_width(config: object) -> tuple[int, int]:
    """(layers, heads x head size) of a transformers decoder config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, heads * head_dim


def training_flops(model: torch.nn.Module, seq_lens: Iterable[int]) -> float:
    """Forward + backward model FLOPs for documents of ``seq_lens`` real tokens each."""
    layers, width = attention_width(model.config)
    lens = list(seq_lens)
    linear = 6 * matmul_params(model) * sum(lens)
    attention = 6 * layers * width * sum(n * (n + 1) for n in lens)
    return float(linear + attention)
