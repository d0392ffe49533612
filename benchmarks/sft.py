"""SFT throughput: drivetrain (fsdp2 engine, in-process) vs TRL's SFTTrainer at its default
and at its fastest documented settings, side by side.

Same model (a 6-layer Llama built locally), same pre-tokenized chat examples with long-tailed
lengths (log-normal, 24..1024 tokens, like real SFT data), same optimizer, fp32, one thread
each. drivetrain packs sequences without padding and cuts 4096-token micro-batches, 16
examples per step. TRL runs three ways (``tests/trl_reference.py``): ``padded`` (its default:
each batch of 16 padded to its longest), ``padding_free`` (each batch one row with position
ids) and ``packing`` (best-fit-decreasing bins of 1100 tokens, padding free, as many bins per
step as carry the tokens of 16 examples). Useful tokens/s counts real tokens, timed over the
optimizer steps after two warm-up steps of each run; MFU is model FLOPs of those tokens
(``flops.py``) over the fp32 matmul peak measured in this run.

Each round runs all four once, the order rotating (``timing.py``, at least 5 rounds; each run
warms up in its own first steps). ``speedup_vs_trl`` is drivetrain over the fastest TRL
configuration (highest median tokens/s), per round; ``speedup_vs_trl_default`` over padded.

Prints a table; the last line is one JSON object.
Usage: uv run python benchmarks/sft.py [--steps N] [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from statistics import median

import torch
from flops import matmul_peak, training_flops
from timing import Measured, Ratio, add_arguments, interleaved, print_result, rounds_of
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model
from drivetrain.trainer.metrics import read_metrics
from drivetrain.trainer.sft.config import DataConfig
from drivetrain.trainer.sft.dataset import tokenize_file
from drivetrain.trainer.sft.job import load_sft_job, prepare, run_sft
from trl_reference import trl_sft

BATCH, WARMUP, MAX_LENGTH = 16, 2, 1100
TRL_LAYOUTS = ("padded", "padding_free", "packing")
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


def drivetrain_run(
    root: Path, model: Path, data: Path, examples: list, steps: int
) -> tuple[int, float]:
    """One drivetrain SFT run: (real tokens, seconds) of its timed steps."""
    job = load_sft_job(
        "fsdp2",
        overrides=[
            f"engine.model.path={model}",
            f"data.train_path={data}",
            f"run.output_dir={root}",
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
    rows = [r for r in read_metrics(root / "metrics.jsonl") if "train/loss" in r]
    tokens = step_tokens(examples, steps)
    timed = [tokens[r["step"] - 1] for r in rows[WARMUP:]]
    seconds = sum(n / r["train/tokens_per_s"] for n, r in zip(timed, rows[WARMUP:], strict=True))
    return sum(timed), seconds


def load_examples(model: Path, data: Path) -> list:
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    return tokenize_file(str(data), tokenizer, DataConfig(max_length=1100))[0]


def batches(examples: list, steps: int) -> list[list]:
    return [examples[s * BATCH : (s + 1) * BATCH] for s in range(steps)]


def step_tokens(examples: list, steps: int) -> list[int]:
    return [sum(map(len, batch)) for batch in batches(examples, steps)]


class StepTimes(TrainerCallback):
    """Each optimizer step's seconds and the real tokens TRL counted in it."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._seen = 0

    def on_step_begin(self, args, state, control, **kw):
        self._began = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self._began)
        self.tokens.append(state.num_input_tokens_seen - self._seen)
        self._seen = state.num_input_tokens_seen


def trl_run(root: Path, model: Path, examples: list, steps: int, layout: str) -> tuple[int, float]:
    """One TRL run in ``layout``: (real tokens, seconds) of its timed steps."""
    timer = StepTimes()
    used = BATCH * steps
    batch = BATCH
    if layout == "packing":  # bins carrying about the tokens of BATCH examples per step
        tokens = sum(map(len, examples[:used]))
        batch = max(1, round(tokens / steps / MAX_LENGTH))
    trl_sft(
        model, examples, batch_size=batch, steps=steps, lr=1e-4, out_dir=root, callbacks=[timer],
        layout=layout, max_length=MAX_LENGTH, examples_used=used,
    )  # fmt: skip
    if len(timer.times) <= WARMUP:
        raise RuntimeError(f"TRL {layout} ran {len(timer.times)} steps, fewer than the warm-up")
    return sum(timer.tokens[WARMUP:]), sum(timer.times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    rounds = rounds_of(args)
    steps = WARMUP + 2 if args.quick else args.steps
    torch.set_num_threads(1)
    runs: dict[str, list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = root / "model"
        build_char_tokenizer(model_dir)
        build_llama_model(
            model_dir, tokenizer_dir=model_dir, tie_word_embeddings=False, hidden_size=256,
            # --quick proves the path runs (CI): 2 layers instead of 6
            intermediate_size=768, num_hidden_layers=2 if args.quick else 6, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1200,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(model_dir)  # for its FLOPs
        data = root / "train.jsonl"
        make_data(data, BATCH * steps)
        examples = load_examples(model_dir, data)
        peak = matmul_peak()
        count = itertools.count()

        def side(name: str, run: Callable[[Path], tuple[int, float]]) -> Measured:
            tokens, seconds = run(root / f"{name}-{next(count)}")
            runs.setdefault(name, []).append((tokens, seconds))
            return Measured(seconds)

        sides = {"drivetrain": lambda: side("drivetrain", lambda out: drivetrain_run(
            out, model_dir, data, examples, steps))}  # fmt: skip
        for layout in TRL_LAYOUTS:
            sides[f"trl_{layout}"] = lambda layout=layout: side(
                f"trl_{layout}", lambda out: trl_run(out, model_dir, examples, steps, layout)
            )
        interleaved(sides, rounds, warmup=0)  # each run warms up in its first steps
    flops_per_token = training_flops(model, map(len, examples)) / sum(map(len, examples))
    rate = {name: [n / s for n, s in r] for name, r in runs.items()}
    fastest = max((n for n in rate if n.startswith("trl_")), key=lambda n: median(rate[n]))
    ratios = {
        "speedup_vs_trl": Ratio.of(rate["drivetrain"], rate[fastest]),
        "speedup_vs_trl_default": Ratio.of(rate["drivetrain"], rate["trl_padded"]),
    }
    padded = sum(BATCH * max(map(len, b)) for b in batches(examples, steps))
    print(f"{'system':<28}{'useful tokens/s':>16}{'MFU':>8}")
    for name, values in rate.items():
        print(f"{name:<28}{median(values):>16,.0f}{median(values) * flops_per_token / peak:>8.3f}")
    print(f"TRL padded computes {padded / sum(step_tokens(examples, steps)):.2f}x the real tokens")
    for name, ratio in ratios.items():
        print(f"{name:<28}{ratio}")
    print_result(
        ratios,
        fastest_trl=fastest,
        tokens_per_s={name: round(median(values)) for name, values in rate.items()},
        mfu={name: round(median(v) * flops_per_token / peak, 3) for name, v in rate.items()},
        matmul_peak_gflops=round(peak / 1e9, 1),
        rounds=rounds,
        steps=steps,
    )


if __name__ == "__main__":
    main()
