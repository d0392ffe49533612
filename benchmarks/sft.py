"""SFT throughput: drivetrain (fsdp2 engine, in-process) vs TRL's SFTTrainer, side by side.

Same model (a 6-layer Llama built locally), same pre-tokenized chat examples with long-tailed
lengths (log-normal, 24..1024 tokens, like real SFT data), same batch size and optimizer, fp32,
one thread each. drivetrain packs sequences without padding and cuts token-budget micro-batches;
TRL pads each batch to its longest sequence (its default). tokens/s counts real tokens, timed
over the optimizer steps after two warm-up steps.

Prints a table; the last line is one JSON object with ``speedup_vs_trl``.
Usage: uv run python benchmarks/sft.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model
from drivetrain.trainer.data.sft_dataset import tokenize_file
from drivetrain.trainer.metrics import read_metrics
from drivetrain.trainer.sft_config import DataConfig
from drivetrain.trainer.sft_job import load_sft_job, prepare, run_sft
from trl_reference import trl_sft

BATCH, WARMUP = 16, 2
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 "


def text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def make_data(path: Path, count: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            total = int(min(1024, max(24, rng.lognormvariate(math.log(160), 0.8))))
            prompt = rng.randint(8, total // 2)
            row = {"prompt": text(rng, prompt), "response": text(rng, total - prompt - 4)}
            f.write(json.dumps(row) + "\n")


def drivetrain_tokens_per_s(root: Path, model: Path, data: Path, steps: int) -> float:
    job = load_sft_job(
        "fsdp2",
        overrides=[
            f"engine.model.path={model}",
            f"data.train_path={data}",
            f"run.output_dir={root / 'drivetrain'}",
            f"run.batch_size={BATCH}",
            f"run.max_steps={steps}",
            "data.max_length=1100",
            "data.shuffle=false",
            "engine.optim.lr=1e-4",
            "engine.optim.weight_decay=0.0",
            "engine.micro_batch.max_tokens=4096",
            "run.export_hf=false",
            "logging.progress=false",
            "logging.tensorboard=false",
            "logging.wandb=false",
        ],
    )
    run_sft(prepare(job), resume="none")
    rows = [r for r in read_metrics(root / "drivetrain" / "metrics.jsonl") if "train/loss" in r]
    timed = rows[WARMUP:]
    tokens = step_tokens(load_examples(model, data), steps)
    seconds = sum(tokens[r["step"] - 1] / r["train/tokens_per_s"] for r in timed)
    return sum(tokens[r["step"] - 1] for r in timed) / seconds


def load_examples(model: Path, data: Path) -> list:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return tokenize_file(str(data), tokenizer, DataConfig(max_length=1100))[0]


def batches(examples: list, steps: int) -> list[list]:
    return [examples[s * BATCH : (s + 1) * BATCH] for s in range(steps)]


def step_tokens(examples: list, steps: int) -> list[int]:
    return [sum(map(len, batch)) for batch in batches(examples, steps)]


class StepTimes(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, args, state, control, **kw):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    steps = parser.parse_args().steps
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = root / "model"
        build_char_tokenizer(model)
        build_llama_model(
            model, tokenizer_dir=model, tie_word_embeddings=False, hidden_size=256,
            intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1200,
        )  # fmt: skip
        data = root / "train.jsonl"
        make_data(data, BATCH * steps)
        ours = drivetrain_tokens_per_s(root, model, data, steps)
        examples = load_examples(model, data)
        timer = StepTimes()
        run = trl_sft(
            model, examples, batch_size=BATCH, steps=steps, lr=1e-4, out_dir=root / "trl",
            callbacks=[timer],
        )  # fmt: skip
        per_step = step_tokens(examples, steps)
        theirs = sum(per_step[WARMUP:]) / sum(timer.times[WARMUP:])
        padded = sum(BATCH * max(map(len, batch)) for batch in batches(examples, steps))
    print(f"{'system':<28}{'tokens/s':>12}")
    print(f"{'TRL SFTTrainer (padded)':<28}{theirs:>12,.0f}")
    print(f"{'drivetrain fsdp2 (packed)':<28}{ours:>12,.0f}")
    print(f"TRL computes {padded / sum(per_step):.2f}x the {run.tokens:,} real tokens (padding)")
    result = {
        "speedup_vs_trl": round(ours / theirs, 3),
        "trl_tokens_per_s": round(theirs),
        "drivetrain_tokens_per_s": round(ours),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
