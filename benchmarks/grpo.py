"""GRPO: drivetrain (fsdp2 engine + HF rollout, in-process) vs TRL's GRPOTrainer, side by side.

Same task (the built-in 1-2 digit addition prompts), same starting model (the built-in SFT
model, trained first if not cached), same reward (exact match), same hyper-parameters: 32
prompts x 8 samples per step, at most 8 new tokens, temperature 1, lr 1e-4 AdamW, one
optimizer step per generation batch, group-std advantages, token-mean loss, no KL, fp32, one
process on the CPU. Each run is a subprocess of its own.

TRL runs at its default generation (``model.generate`` over padded batches), which is also
its fastest path on this machine without vLLM: transformers' continuous batching
(``use_transformers_continuous_batching``, ``--trl-continuous`` adds it) measured 10.4 s/step
here against 0.40 (2026-11-24, 5 rounds). Each round runs the configurations once, the order
rotating (``timing.py``, at least 5 rounds; each run warms up in its first step).

Seconds per step: a run's median over the steps after its first. Useful tokens/s: the prompt
and completion tokens of those steps (no padding; TRL's own ``num_tokens`` count) over their
seconds. No MFU: drivetrain computes each prompt once for its samples (shared prefixes), TRL
once per sample, so the FLOPs behind a useful token differ between the two.
``step_speedup_vs_trl``: per round, the fastest TRL configuration's (the lowest median) s/step
over drivetrain's; median and min-max. Reward: the train reward averaged over the last 5
steps, and greedy exact-match accuracy on the 200 held-out problems of the last round's
models (the same scorer for all).

Prints a table; the last line is one JSON object.
Usage: uv run python benchmarks/grpo.py [--steps N] [--pairs N] [--quick] [--trl-continuous]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import Measured, add_arguments, interleaved, print_result, rounds_of, speedup

PROMPTS, GROUP, NEW_TOKENS, LR = 32, 8, 8, 1e-4


def run_drivetrain(out: Path, steps: int) -> dict:
    cmd = [
        sys.executable, "-m", "drivetrain.trainer", "grpo", f"run.output_dir={out}",
        f"run.steps={steps}", f"run.prompts_per_step={PROMPTS}", f"sampling.n={GROUP}",
        f"sampling.max_new_tokens={NEW_TOKENS}", f"actor.optim.lr={LR}", "run.save_every=0",
        "logging.progress=false", "logging.tensorboard=false", "data.val_size=1",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    step_s = [sum(v for k, v in r.items() if k.startswith("time/")) for r in rows]
    tokens = [r["perf/tokens_per_s"] * s for r, s in zip(rows, step_s, strict=True)]
    return {"step_s": step_s, "step_tokens": tokens, "rewards": [r["reward/mean"] for r in rows],
            "model": out / "hf"}  # fmt: skip


def trl_worker(out: Path, steps: int, continuous: bool) -> None:
    """Runs in a subprocess: TRL's GRPOTrainer on the same task; writes its timings."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from drivetrain.trainer.builtin import addition
    from drivetrain.trainer.rl.rewards import exact_match

    torch.set_num_threads(1)
    assets = addition.ensure_assets()
    model_dir = addition.cached_sft_model()
    rows = [json.loads(x) for x in assets.rl_path.read_text().splitlines()]
    data = Dataset.from_list(
        [
            {"prompt": [r["messages"][0]], "answer": r["messages"][1]["content"]}
            for r in rows[: PROMPTS * (steps + 1)]
        ]
    )

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [exact_match(c[0]["content"], a) for c, a in zip(completions, answer, strict=True)]

    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *args: object, **kwargs: object) -> None:
            stamps.append(time.perf_counter())

        def on_train_begin(self, *args: object, **kwargs: object) -> None:
            stamps.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=NEW_TOKENS,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
        warmup_steps=0, temperature=1.0, beta=0.0, loss_type="dapo", scale_rewards="group",
        use_cpu=True, logging_steps=1, report_to=[], save_strategy="no", seed=0,
        dataloader_num_workers=0, shuffle_dataset=True,
        use_transformers_continuous_batching=continuous,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=data,
        processing_class=tokenizer, callbacks=[Stamp()],
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "hf"))
    tokenizer.save_pretrained(str(out / "hf"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    step_s = [b - a for a, b in itertools.pairwise(stamps)]
    seen = [0] + [h["num_tokens"] for h in trainer.state.log_history if "num_tokens" in h]
    tokens = [b - a for a, b in itertools.pairwise(seen)]  # prompt + completion, no padding
    (out / "timings.json").write_text(
        json.dumps({"step_s": step_s, "step_tokens": tokens, "rewards": rewards})
    )


def run_trl(out: Path, steps: int, continuous: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "--trl-worker", str(out), "--steps", str(steps)]
    cmd += ["--continuous"] if continuous else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    timings = json.loads((out / "timings.json").read_text())
    return {**timings, "model": out / "hf"}


def useful_rate(run: dict) -> float:
    """Real tokens per second over the steps after the first."""
    return sum(run["step_tokens"][1:]) / sum(run["step_s"][1:])


def accuracy(model_dir: Path) -> float:
    from drivetrain.trainer.builtin import addition
    from drivetrain.trainer.builtin.exact_match import exact_match

    rows = [json.loads(x) for x in addition.ensure_assets().test_path.read_text().splitlines()]
    return exact_match(str(model_dir), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trl-worker")
    parser.add_argument("--continuous", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trl-continuous", action="store_true",
                        help="also TRL with transformers' continuous batching")  # fmt: skip
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.trl_worker), args.steps, args.continuous)
        return
    rounds = rounds_of(args)
    steps = 3 if args.quick else args.steps
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from drivetrain.trainer.builtin import addition
    from drivetrain.trainer.builtin.addition_sft import ensure_sft_model

    start_model = ensure_sft_model(addition.ensure_assets(), None)
    runs = {
        "drivetrain": run_drivetrain,
        "trl_generate": lambda out, n: run_trl(out, n, continuous=False),
    }
    if args.trl_continuous:
        runs["trl_continuous"] = lambda out, n: run_trl(out, n, continuous=True)
    results: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:

        def side(name: str) -> Measured:
            result = runs[name](Path(tmp) / f"{name}-{len(results[name])}", steps)
            results[name].append(result)
            return Measured(statistics.median(result["step_s"][1:]))

        times = interleaved({name: lambda n=name: side(n) for name in runs}, rounds, warmup=0)
        start_acc = accuracy(start_model)
        rate = {name: statistics.median(useful_rate(r) for r in rs) for name, rs in results.items()}
        table = {
            name: {
                "s_per_step": statistics.median(times[name]),
                "useful_tokens_per_s": round(rate[name], 1),
                "reward_last5": statistics.mean(r[-1]["rewards"][-5:]),
                "accuracy": accuracy(r[-1]["model"]),
            }
            for name, r in results.items()
        }
    trl = [name for name in runs if name.startswith("trl_")]
    fastest = min(trl, key=lambda n: table[n]["s_per_step"])
    ratios = {
        "step_speedup_vs_trl": speedup(times, "drivetrain", fastest),
        "step_speedup_vs_trl_default": speedup(times, "drivetrain", "trl_generate"),
    }
    print(f"GRPO, {steps} steps of {PROMPTS} prompts x {GROUP} samples, {rounds} rounds "
          f"(start accuracy {start_acc:.1%})")  # fmt: skip
    print(f"{'':16}{'s/step':>10}{'tokens/s':>10}{'reward (last 5)':>18}{'accuracy after':>16}")
    for name, row in table.items():
        print(
            f"{name:16}{row['s_per_step']:>10.2f}{row['useful_tokens_per_s']:>10.0f}"
            f"{row['reward_last5']:>18.3f}{row['accuracy']:>16.1%}"
        )
    for name, ratio in ratios.items():
        print(f"{name:<28}{ratio}")
    print_result(
        ratios, fastest_trl=fastest, steps=steps, rounds=rounds, start_accuracy=start_acc,
        **table,
    )  # fmt: skip


if __name__ == "__main__":
    main()
