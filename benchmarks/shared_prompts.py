"""Shared prompts in GRPO: each prompt computed once for its n samples vs once per sample,
side by side, for the two places drivetrain does it.

- generate: the HF rollout with ``share_prompt_prefill`` on vs off (32 prompts x 8 samples,
  8 new tokens, temperature 1, the same seed: the completions are compared too);
- update: engine-fsdp (fsdp2) forward + backward of those 256 completions with the
  ``shared_prefix_len`` hint (what the RL trainer passes) vs without (same loss, compared).

The built-in task and SFT model (trained first if not cached), fp32, one thread, median of 5
after a warm-up. The last line is JSON with ``generate_speedup`` and ``update_speedup``.
Usage: uv run python benchmarks/shared_prompts.py
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from drivetrain.api import Prompt, SamplingParams
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK, SHARED_PREFIX_LEN
from drivetrain.api.config import MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.api.registry import engines, rollouts
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.rl.batch_ops import completions_batch, engine_view
from drivetrain.trainer.rl.job import ensure_sft_model

PROMPTS, GROUP, NEW_TOKENS, REPEATS = 32, 8, 8, 5


def median_seconds(fn: Callable[[], object]) -> float:
    fn()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def nll(outputs, micro_batch, ctx):
    mask = micro_batch[LOSS_MASK].to(outputs[LOG_PROBS].dtype)
    return -(outputs[LOG_PROBS] * mask).sum() / ctx.global_tokens, {}


def main() -> None:
    torch.set_num_threads(1)
    assets = addition.ensure_assets()
    model = ensure_sft_model(assets, None)
    rows = [json.loads(x) for x in assets.rl_path.read_text().splitlines()[:PROMPTS]]
    prompts = [Prompt(messages=(r["messages"][0],)) for r in rows]
    params = SamplingParams(n=GROUP, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0)

    hf = {
        share: rollouts.load("hf")(
            HFRolloutConfig(model_path=str(model), max_batch_size=256, share_prompt_prefill=share)
        )
        for share in (True, False)
    }
    completions = {share: r.generate(prompts, params) for share, r in hf.items()}
    same = [c.token_ids for c in completions[True]] == [c.token_ids for c in completions[False]]
    generate = {
        share: median_seconds(lambda r=r: r.generate(prompts, params)) for share, r in hf.items()
    }

    config = engines.load_config_class("fsdp2", object)(
        model=ModelConfig(path=str(model)),
        optim=OptimConfig(lr=1e-4),
        micro_batch=MicroBatchConfig(max_tokens=16384),  # as the built-in GRPO job: one
        device="cpu",
    )
    engine = engines.load("fsdp2")(config)
    engine.initialize()
    hinted = engine_view(completions_batch(completions[True], pad_token_id=0))
    batches = {True: hinted, False: hinted.drop(SHARED_PREFIX_LEN)}

    def step(batch) -> float:
        with engine.train_mode():
            engine.optimizer_zero_grad()
            return engine.forward_backward(batch, nll).loss

    losses = {share: step(b) for share, b in batches.items()}
    update = {share: median_seconds(lambda b=b: step(b)) for share, b in batches.items()}
    engine.close()

    print(f"shared prompts, {PROMPTS} prompts x {GROUP} samples, built-in model, one thread")
    print(f"{'':24}{'shared':>10}{'per sample':>12}{'speedup':>9}")
    for name, t in (("generate (HF rollout) s", generate), ("update (fsdp2 fwd+bwd) s", update)):
        print(f"{name:24}{t[True]:>10.3f}{t[False]:>12.3f}{t[False] / t[True]:>8.2f}x")
    print(f"same completions: {same}; loss {losses[True]:.6f} vs {losses[False]:.6f}")
    print(json.dumps({
        "generate_speedup": round(generate[False] / generate[True], 2),
        "update_speedup": round(update[False] / update[True], 2),
        "same_completions": same,
        "loss_abs_diff": abs(losses[True] - losses[False]),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
