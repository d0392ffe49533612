"""What routing replay does on a mixture-of-experts model: the built-in addition task's GRPO
with ``algorithm.routing_replay`` off (the baseline) and ``rollout``, side by side.

The model: a Qwen3-MoE the size of the built-in one (hidden 128, 3 layers, 8 experts of 96,
top-2, the char tokenizer), trained first with the built-in SFT config (``--sft-steps``, once
per benchmark), then GRPO from it, as the built-in job runs (hf rollout, fsdp2, float32, one
thread), except that the rollout samples in ``--rollout-dtype`` (bfloat16) while the trainer
computes in float32, as a rollout run in lower precision for speed does: on this CPU a rollout
and a trainer of one dtype route alike (bf16 and fp32 kernels here give a row the same bits
whatever the batch), so the dtypes are the source of the mismatch here, as kernels are on GPUs.
Both modes record the rollout's routing (``rollout.return_routed_experts=true``), so
both report how the experts the update's forward used differ from the rollout's
(``routing/mismatch_share``); ``rollout`` replays them. A round is one run of each with the same
seed (``seed=<round>``), the order alternating; every run is a fresh process. Each run
validates greedily on ``--val-size`` held-out problems before and after.

The last line is JSON: ``routing_mismatch_share`` (``off``/``on``: the mean over every step of
every run), ``log_prob_gap`` (``off``/``on``: the mean of ``actor/rollout_log_prob_diff``, the
rollout's log-probs against the update's, over steps and runs) and ``log_prob_gap_max``,
``log_prob_gap_ratio_on_vs_off`` (per round: on's mean gap over off's; median with min-max),
``step_time_ratio_on_vs_off``, ``reward`` (mean sampled reward of the last 5 steps, median over
runs), ``accuracy_before``/``accuracy_after`` (median greedy exact-match), ``rounds``, ``steps``.
Usage: uv run python benchmarks/routing_replay.py [--pairs N] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import Ratio, add_arguments, order, print_result, rounds_of, run_grpo

from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.addition_sft import CONFIG as SFT_CONFIG
from drivetrain.trainer.builtin.tiny_model import build_moe_model

MODES = {
    "off": ["algorithm.routing_replay=off", "rollout.return_routed_experts=true"],
    "on": ["algorithm.routing_replay=rollout"],
}
SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip


def sft_model(root: Path, steps: int) -> Path:
    """The MoE model trained on the built-in SFT task (its config, ``steps`` steps)."""
    assets = addition.ensure_assets()
    base = build_moe_model(
        root / "moe", tokenizer_dir=assets.model_dir, experts=8, top_k=2, **SHAPE
    )
    out = root / "sft"
    command = [
        sys.executable, "-m", "drivetrain.trainer", "sft", "-c", str(SFT_CONFIG),
        f"engine.model.path={base}", f"data.train_path={assets.train_path}",
        f"run.output_dir={out}", f"run.max_steps={steps}", "run.save_every=0",
        "logging.progress=false", "logging.tensorboard=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"the MoE SFT run failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        f"MoE SFT model: {steps} steps, {summary.get('accuracy_after', '?')} accuracy", flush=True
    )
    return Path(summary["hf_model"])


def run(
    mode: str, model: Path, steps: int, seed: int, out: Path, val: int, dtype: str
) -> dict[str, object]:
    assets = addition.assets_at()
    args = [
        # provenance compares fingerprints in the trainer's dtype: a bf16 rollout fails it
        *MODES[mode], f"actor.model.path={model}", f"rollout.dtype={dtype}",
        "weight_sync.provenance=false",
        f"data.train_path={assets.rl_path}",
        f"data.val_path={assets.test_path}", f"data.val_size={val}", f"run.steps={steps}",
        f"seed={seed}", "run.prompts_per_step=32",
    ]  # fmt: skip
    job = run_grpo(args, out, mode)
    rows = job.steps("actor/loss")
    return {
        **job.summary,
        "mismatch": [r["routing/mismatch_share"] for r in rows],
        "gap": [r["actor/rollout_log_prob_diff"] for r in rows],
        "gap_max": max(r["actor/rollout_log_prob_diff_max"] for r in rows),
        "reward": statistics.mean(r["reward/mean"] for r in rows[-5:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--val-size", type=int, default=200)
    parser.add_argument("--rollout-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args()
    rounds = rounds_of(args)
    steps, sft_steps = (3, 20) if args.quick else (args.steps, args.sft_steps)
    val = 8 if args.quick else args.val_size
    mismatch: dict[str, list[float]] = {m: [] for m in MODES}
    gaps: dict[str, list[float]] = {m: [] for m in MODES}
    gap_max = dict.fromkeys(MODES, 0.0)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    reward: dict[str, list[float]] = {m: [] for m in MODES}
    before: dict[str, list[float]] = {m: [] for m in MODES}
    after: dict[str, list[float]] = {m: [] for m in MODES}
    round_gap: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="routing-") as tmp:
        model = sft_model(Path(tmp), sft_steps)
        for seed in range(rounds):
            for mode in order(list(MODES), seed):
                out = Path(tmp) / f"{mode}-{seed}"
                summary = run(mode, model, steps, seed, out, val, args.rollout_dtype)
                mismatch[mode] += summary["mismatch"]
                gaps[mode] += summary["gap"]
                round_gap[mode].append(statistics.mean(summary["gap"]))
                gap_max[mode] = max(gap_max[mode], summary["gap_max"])
                seconds[mode].append(summary["loop_seconds"] / summary["steps"])
                reward[mode].append(summary["reward"])
                before[mode].append(summary["val_before"]["val/exact_match"])
                after[mode].append(summary["val_after"]["val/exact_match"])
                print(
                    f"round {seed} {mode}: routing mismatch "
                    f"{statistics.mean(summary['mismatch']):.4f}, log-prob gap "
                    f"{round_gap[mode][-1]:.3g} (max {summary['gap_max']:.3g}), reward "
                    f"{summary['reward']:.3f}, greedy accuracy {before[mode][-1]:.3f} -> "
                    f"{after[mode][-1]:.3f}, {seconds[mode][-1]:.3f} s/step",
                    flush=True,
                )
    gap_ratio = Ratio.of(round_gap["on"], round_gap["off"])
    time_ratio = Ratio.of(seconds["on"], seconds["off"])
    print(f"{'log_prob_gap_ratio_on_vs_off':<36}{gap_ratio}")
    print(f"{'step_time_ratio_on_vs_off':<36}{time_ratio}")

    def per_mode(values: dict[str, list[float]], fn=statistics.median) -> dict[str, float]:
        return {m: float(f"{fn(v):.4g}") for m, v in values.items()}

    print_result(
        {"log_prob_gap_ratio_on_vs_off": gap_ratio, "step_time_ratio_on_vs_off": time_ratio},
        routing_mismatch_share=per_mode(mismatch, statistics.mean),
        log_prob_gap=per_mode(gaps, statistics.mean),
        log_prob_gap_max=gap_max,
        reward=per_mode(reward),
        accuracy_before=per_mode(before),
        accuracy_after=per_mode(after),
        rounds=rounds,
        steps=steps,
        sft_steps=sft_steps,
        rollout_dtype=args.rollout_dtype,
    )


if __name__ == "__main__":
    main()
