"""engine-fsdp throughput on this machine, measured side by side with the baselines.

1. overhead_ratio: drivetrain fsdp2 (world size 1) tokens/s ÷ a hand-written PyTorch loop
   (HF forward with labels, backward, AdamW) on the same model and batch.
2. packing_speedup: packed rows + token-budget micro-batches ÷ padded fixed-size micro-batches,
   both drivetrain, lengths uniform in 16..512 (tokens/s counts real tokens).
3. mfu: achieved model FLOP/s (6 * params * tokens/s) ÷ this machine's measured fp32 matmul FLOP/s.

Prints a table; the last line is one JSON object. Usage: uv run python benchmarks/engine_fsdp.py
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from drivetrain.api import Batch, MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.api.testing import token_mean_nll
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.engine import FSDP2Engine

VOCAB = 16384


def build_model(path: Path) -> int:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=384, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def make_batch(lengths: list[int], seed: int) -> Batch:
    rng = random.Random(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor([rng.randrange(3, VOCAB) for _ in range(n)])
        mask[i, 1:n] = 1.0
    return Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=lengths)


def matmul_flops() -> float:
    a, b = torch.randn(1024, 2048), torch.randn(2048, 2048)
    for _ in range(3):
        a @ b
    start, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    return 2 * 1024 * 2048 * 2048 * n / (time.perf_counter() - start)


def engine_tokens_per_s(model_dir: Path, batch: Batch, steps: int, **overrides) -> float:
    micro = overrides.pop("micro_batch")
    config = FSDPConfig(
        model=ModelConfig(path=str(model_dir)),
        optim=OptimConfig(lr=1e-4, weight_decay=0.0, clip_grad=1.0),
        micro_batch=micro,
        device="cpu",
        **overrides,
    )
    engine = FSDP2Engine(config)
    engine.initialize()

    def step() -> None:
        with engine.train_mode():
            engine.optimizer_zero_grad()
            engine.forward_backward(batch, token_mean_nll)
            engine.optimizer_step()
            engine.lr_scheduler_step()

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    elapsed = time.perf_counter() - start
    engine.close()
    return batch.num_tokens * steps / elapsed


def plain_tokens_per_s(model_dir: Path, batch: Batch, steps: int) -> float:
    """The baseline: what one writes by hand with transformers and torch."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    ids = batch["input_ids"]
    attention = (torch.arange(ids.shape[1])[None] < torch.tensor(batch.seq_lens)[:, None]).long()
    labels = ids.masked_fill(attention == 0, -100)

    def step() -> None:
        optim.zero_grad()
        loss = model(input_ids=ids, attention_mask=attention, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return batch.num_tokens * steps / (time.perf_counter() - start)


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = build_model(model_dir)
        peak = matmul_flops()

        same = make_batch([128] * 8, seed=0)  # equal lengths: no padding advantage either way
        plain = plain_tokens_per_s(model_dir, same, steps)
        ours = engine_tokens_per_s(
            model_dir, same, steps, micro_batch=MicroBatchConfig(micro_batch_size=8)
        )

        rng = random.Random(1)
        varied = make_batch([rng.randint(16, 512) for _ in range(16)], seed=2)
        packed = engine_tokens_per_s(
            model_dir, varied, steps, micro_batch=MicroBatchConfig(max_tokens=2048)
        )
        padded = engine_tokens_per_s(
            model_dir, varied, steps, micro_batch=MicroBatchConfig(micro_batch_size=4),
            attention="sdpa", remove_padding=False,
        )  # fmt: skip

    lens = varied.seq_lens
    padded_tokens = sum(max(lens[i : i + 4]) * len(lens[i : i + 4]) for i in range(0, len(lens), 4))
    rows = [
        ("plain PyTorch loop, 8x128", plain),
        ("drivetrain fsdp2, 8x128", ours),
        ("drivetrain padded, mbs 4, 16..512", padded),
        ("drivetrain packed, 2048-token budget, 16..512", packed),
    ]
    print(f"model: {params / 1e6:.1f}M params, fp32, {torch.get_num_threads()} threads; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s")  # fmt: skip
    print(f"{'configuration':<48} {'tokens/s':>10}")
    for name, value in rows:
        print(f"{name:<48} {value:>10.1f}")
    result = {
        "overhead_ratio": round(ours / plain, 3),
        "packing_speedup": round(packed / padded, 3),
        "mfu": round(6 * params * ours / peak, 3),
        "padded_token_ratio": round(padded_tokens / varied.num_tokens, 3),
        "params_m": round(params / 1e6, 1),
    }
    print(f"{'overhead_ratio (goal >= 0.95)':<48} {result['overhead_ratio']:>10.3f}")
    print(f"{'packing_speedup (goal >= 2.0)':<48} {result['packing_speedup']:>10.3f}")
    print(
        f"{'  padded/real tokens of that baseline':<48} {padded_tokens / varied.num_tokens:>10.3f}"
    )
    print(f"{'model FLOP/s / matmul FLOP/s':<48} {result['mfu']:>10.3f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
