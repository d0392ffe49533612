"""Shared prompts in GRPO: each prompt computed once for its n samples vs once per sample,
side by side, for the two places drivetrain does it.

- generate: the HF rollout with ``share_prompt_prefill`` on vs off (32 prompts x 8 samples,
  8 new tokens, temperature 1, the same seed: the completions are compared too);
- update: engine-fsdp (fsdp2) forward + backward of those 256 completions with the
  ``shared_prefix_len`` hint (what the RL trainer passes) vs without (same loss, compared).

The built-in task and SFT model (trained first if not cached), fp32, one thread. Shared and
per-sample runs are interleaved (``timing.py``: one warm-up round, at least 5 timed rounds,
one ratio per round). The last line is JSON with ``generate_speedup`` and ``update_speedup``
(medians) and their spreads.
Usage: uv run python benchmarks/shared_prompts.py [--pairs N] [--quick]
"""

from __future__ import annotations

import argparse
import json
from statistics import median

import torch
from timing import add_arguments, interleaved, print_result, rounds_of, speedup

from drivetrain.api import Prompt, SamplingParams
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK, SHARED_PREFIX_LEN
from drivetrain.api.config import MicroBatchConfig, ModelConfig, OptimConfig
from drivetrain.api.registry import engines, rollouts
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.addition_sft import ensure_sft_model
from drivetrain.trainer.rl.batch_ops import completions_batch, engine_view

PROMPTS, GROUP, NEW_TOKENS = 32, 8, 8


def nll(outputs, micro_batch, ctx):
    mask = micro_batch[LOSS_MASK].to(outputs[LOG_PROBS].dtype)
    return -(outputs[LOG_PROBS] * mask).sum() / ctx.global_tokens, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    rounds = rounds_of(parser.parse_args())
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
    generate = interleaved(
        {
            "shared": lambda: hf[True].generate(prompts, params),
            "per_sample": lambda: hf[False].generate(prompts, params),
        },
        rounds,
    )

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
    update = interleaved(
        {"shared": lambda: step(batches[True]),
         "per_sample": lambda: step(batches[False])},
        rounds,
    )  # fmt: skip
    engine.close()

    print(f"shared prompts, {PROMPTS} prompts x {GROUP} samples, built-in model, one thread")
    print(f"{'':24}{'shared':>10}{'per sample':>12}  speedup [min, max]")
    ratios = {
        "generate_speedup": speedup(generate, "shared", "per_sample"),
        "update_speedup": speedup(update, "shared", "per_sample"),
    }
    for (name, t), ratio in zip(
        (("generate (HF rollout) s", generate), ("update (fsdp2 fwd+bwd) s", update)),
        ratios.values(), strict=True,
    ):  # fmt: skip
        print(f"{name:24}{median(t['shared']):>10.3f}{median(t['per_sample']):>12.3f}  {ratio}")
    print(f"same completions: {same}; loss {losses[True]:.6f} vs {losses[False]:.6f}")
    print_result(
        ratios,
        same_completions=same,
        loss_abs_diff=abs(losses[True] - losses[False]),
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
