"""engine-fsdp training throughput on this machine, side by side with its baselines.

One optimizer step is one unit of work, one torch thread (a thread of a busy 2-core machine
stalls less than two). Two comparisons, each timed through ``timing.py`` (interleaved,
rotated every round, one warm-up round, at least 5 timed rounds, one ratio per round), so
the configurations a ratio compares run back to back:

1. engine overhead: ``plain``, a hand-written PyTorch loop (HF forward with labels, backward,
   clip, AdamW) on 8 rows of 128 tokens, vs ``fsdp2``, drivetrain fsdp2 (world size 1) on the
   same batch;
2. layouts:

- ``dense``: drivetrain on 8 equal rows of 256 tokens in its row layout (SDPA over
  ``[rows, tokens]``; equal rows carry no padding): the dense limit of this engine;
- ``packed``: 16 documents of 16..512 tokens packed into rows, 2048-token micro-batches;
- ``padded``: the same documents padded, 4 per micro-batch, SDPA with a mask.

Reported: useful (real) tokens/s and MFU (model FLOPs of the real tokens ÷ the fp32 matmul
peak measured in this run: ``flops.py``) of each, and the ratios
``overhead_ratio`` (fsdp2 ÷ plain tokens/s; goal >= 0.95), ``packed_mfu_vs_dense`` (goal >=
0.7) and ``packing_speedup`` (packed ÷ padded tokens/s; padding wastes ``padded_token_ratio``
x the real tokens there, which bounds it).

The last line is one JSON object. Usage: uv run python benchmarks/engine_fsdp.py [--pairs N]
[--quick]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch
from flops import matmul_peak, training_flops
from timing import Ratio, add_arguments, interleaved, print_result, rates, rounds_of
from transformers import AutoModelForCausalLM, Qwen2Config

from drivetrain.api import Batch, MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.engine import FSDP2Engine
from drivetrain.testing import token_mean_nll

VOCAB = 16384
#: the engine's row layout: SDPA over [rows, tokens] with a padding mask, no packing
ROW_LAYOUT = {"attention": "sdpa", "remove_padding": False}


def build_model(path: Path, layers: int) -> torch.nn.Module:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=384, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return model


def make_batch(lengths: list[int], seed: int, vocab: int = VOCAB) -> Batch:
    """Random documents of ``lengths`` tokens, one per row; every token but the first counts."""
    rng = random.Random(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        mask[i, 1:n] = 1.0
    return Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=lengths)


def engine_step(model_dir: Path, batch: Batch, **overrides: object) -> Callable[[], None]:
    """One drivetrain optimizer step on ``batch`` (the engine stays up between calls)."""
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

    return step


def plain_step(model_dir: Path, batch: Batch) -> Callable[[], None]:
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

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    rounds = rounds_of(args)
    torch.set_num_threads(1)
    layers, longest = (2, 128) if args.quick else (8, 512)
    rng = random.Random(1)
    batches = {
        "plain": make_batch([128] * 8, seed=0),  # equal lengths: no padding either way
        "dense": make_batch([256] * 8, seed=3),
        "varied": make_batch([rng.randint(16, longest) for _ in range(16)], seed=2),
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model = build_model(model_dir, layers)
        peak = matmul_peak()
        sides = {
            "plain": plain_step(model_dir, batches["plain"]),
            "fsdp2": engine_step(
                model_dir, batches["plain"], micro_batch=MicroBatchConfig(micro_batch_size=8)
            ),
            "dense": engine_step(
                model_dir,
                batches["dense"],
                micro_batch=MicroBatchConfig(micro_batch_size=8),
                **ROW_LAYOUT,
            ),
            "packed": engine_step(
                model_dir, batches["varied"], micro_batch=MicroBatchConfig(max_tokens=2048)
            ),
            "padded": engine_step(
                model_dir,
                batches["varied"],
                micro_batch=MicroBatchConfig(micro_batch_size=4),
                **ROW_LAYOUT,
            ),
        }
        times = interleaved({n: sides[n] for n in ("plain", "fsdp2")}, rounds)
        times |= interleaved({n: sides[n] for n in ("dense", "packed", "padded")}, rounds)
    data = {
        "plain": batches["plain"], "fsdp2": batches["plain"], "dense": batches["dense"],
        "packed": batches["varied"], "padded": batches["varied"],
    }  # fmt: skip
    tokens = {name: rates(batch.num_tokens, times[name]) for name, batch in data.items()}
    mfu = {
        name: [training_flops(model, batch.seq_lens) / s / peak for s in times[name]]
        for name, batch in data.items()
    }
    lens = batches["varied"].seq_lens
    padded_tokens = sum(max(lens[i : i + 4]) * len(lens[i : i + 4]) for i in range(0, len(lens), 4))
    ratios = {
        "overhead_ratio": Ratio.of(tokens["fsdp2"], tokens["plain"]),
        "packed_mfu_vs_dense": Ratio.of(mfu["packed"], mfu["dense"]),
        "packing_speedup": Ratio.of(tokens["packed"], tokens["padded"]),
    }
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M params, fp32, {torch.get_num_threads()} threads; "
          f"matmul peak {peak / 1e9:.1f} GFLOP/s; {rounds} interleaved rounds")  # fmt: skip
    labels = {
        "plain": "plain PyTorch loop, 8x128",
        "fsdp2": "drivetrain fsdp2, 8x128",
        "dense": "drivetrain dense, 8x256",
        "packed": f"drivetrain packed, 2048-token budget, 16..{longest}",
        "padded": f"drivetrain padded, mbs 4, 16..{longest}",
    }
    print(f"{'configuration':<46}{'useful tokens/s':>16}{'MFU':>8}")
    for name, label in labels.items():
        print(f"{label:<46}{median(tokens[name]):>16.1f}"
              f"{median(mfu[name]):>8.3f}")  # fmt: skip
    goals = {"overhead_ratio": ">= 0.95", "packed_mfu_vs_dense": ">= 0.7", "packing_speedup": ""}
    for name, ratio in ratios.items():
        goal = f" (goal {goals[name]})" if goals[name] else ""
        print(f"{name + goal:<46}{ratio}")
    print(f"{'  padded/real tokens of the padded baseline':<46}{padded_tokens / sum(lens):.3f}")
    print_result(
        ratios,
        mfu=round(median(mfu["fsdp2"]), 3),
        mfu_by_configuration={n: round(median(v), 3) for n, v in mfu.items()},
        useful_tokens_per_s={n: round(median(v), 1) for n, v in tokens.items()},
        padded_token_ratio=round(padded_tokens / sum(lens), 3),
        matmul_peak_gflops=round(peak / 1e9, 1),
        params_m=round(params / 1e6, 1),
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
