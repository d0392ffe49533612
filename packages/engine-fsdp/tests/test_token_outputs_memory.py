"""The log-prob path's largest tensor, at the GPU workload's size, measured on the meta device.

The first H100 run trains a 1B Llama on 16k-token micro-batches with a 32k vocabulary: fp32
logits for all tokens at once would be 16,384 x 32,000 x 4 B = 2 GiB per tensor, several of
them alive in backward. ``next_token_outputs`` computes a chunk of tokens at a time (and
recomputes each chunk in backward), so no tensor of forward or backward may exceed one chunk's
fp32 logits. Every op's outputs are recorded (a dispatch mode over meta tensors: no memory, no
compute), so a regression that materialises the whole row's logits fails here, on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.token_outputs import next_token_outputs

TOKENS, HIDDEN, VOCAB = 16_384, 2048, 32_000


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.op = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() * t.element_size() > self.bytes:
                self.bytes, self.op = t.numel() * t.element_size(), str(func)
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("want_entropy", [False, True])
def test_no_tensor_exceeds_one_chunk_of_fp32_logits(dtype, want_entropy):
    chunk = FSDPConfig().chunk_tokens(VOCAB)  # the default: 256 MiB of fp32 logits
    assert chunk < TOKENS
    hidden = torch.empty(TOKENS, HIDDEN, device="meta", dtype=dtype, requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, device="meta", dtype=dtype, requires_grad=True)
    targets = torch.zeros(TOKENS, device="meta", dtype=torch.long)
    largest = LargestTensor()
    with largest:
        log_probs, entropy = next_token_outputs(
            hidden, weight, None, targets, temperature=0.7, want_entropy=want_entropy,
            chunk=chunk,
        )  # fmt: skip
        (log_probs.sum() + entropy.sum()).backward()
    bound = chunk * VOCAB * 4
    assert largest.bytes <= bound, (largest.bytes, largest.op)
    # and it is the chunk's logits, not a smaller stand-in: the guard measures what it claims
    assert largest.bytes >= bound // 2, (largest.bytes, largest.op)
    whole_row = TOKENS * VOCAB * 4
    assert largest.bytes * 4 <= whole_row
