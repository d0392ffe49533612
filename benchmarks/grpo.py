"""GRPO: drivetrain (fsdp2 engine + HF rollout, in-process) vs TRL's GRPOTrainer, side by side.

Same task (the built-in 1-2 digit addition prompts), same starting model (the built-in SFT
model, trained first if not cached), same reward (exact match), same hyper-parameters: 32
prompts x 8 samples per step, at most 8 new tokens, temperature 1, lr 1e-4 AdamW, one
optimizer step per generation batch, group-std advantages, token-mean loss, no KL, fp32, one
process on the CPU. Each framework runs in its own subprocess, one after the other.

Seconds per step: median over the steps after a warm-up step. Reward: the train reward
averaged over the last 5 steps, and greedy exact-match accuracy of each trained model on the
200 held-out problems (the same scorer for both).

Prints a table; the last line is one JSON object with ``step_speedup_vs_trl``.
Usage: uv run python benchmarks/grpo.py [--steps N]
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
    return {"step_s": step_s, "rewards": [r["reward/mean"] for r in rows], "model": out / "hf"}


def trl_worker(out: Path, steps: int) -> None:
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
    (out / "timings.json").write_text(json.dumps({"step_s": step_s, "rewards": rewards}))


def run_trl(out: Path, steps: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "--trl-worker", str(out), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    timings = json.loads((out / "timings.json").read_text())
    return {**timings, "model": out / "hf"}


def accuracy(model_dir: Path) -> float:
    from drivetrain.trainer.builtin import addition
    from drivetrain.trainer.builtin.exact_match import exact_match

    rows = [json.loads(x) for x in addition.ensure_assets().test_path.read_text().splitlines()]
    return exact_match(str(model_dir), rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--trl-worker")
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.trl_worker), args.steps)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from drivetrain.trainer.builtin import addition
    from drivetrain.trainer.rl.job import ensure_sft_model

    start_model = ensure_sft_model(addition.ensure_assets(), None)
    with tempfile.TemporaryDirectory() as tmp:
        results = {
            "drivetrain": run_drivetrain(Path(tmp) / "dt", args.steps),
            "trl": run_trl(Path(tmp) / "trl", args.steps),
        }
        start_acc = accuracy(start_model)
        table = {}
        for name, r in results.items():
            table[name] = {
                "s_per_step": statistics.median(r["step_s"][1:]),
                "reward_last5": statistics.mean(r["rewards"][-5:]),
                "accuracy": accuracy(r["model"]),
            }
    dt, trl = table["drivetrain"], table["trl"]
    speedup = trl["s_per_step"] / dt["s_per_step"]
    print(f"GRPO, {args.steps} steps of {PROMPTS} prompts x {GROUP} samples "
          f"(start accuracy {start_acc:.1%})")  # fmt: skip
    print(f"{'':12}{'s/step':>10}{'reward (last 5)':>18}{'accuracy after':>16}")
    for name, row in table.items():
        print(
            f"{name:12}{row['s_per_step']:>10.2f}{row['reward_last5']:>18.3f}"
            f"{row['accuracy']:>16.1%}"
        )
    print(f"step speedup vs TRL: {speedup:.2f}x")
    print(json.dumps({
        "steps": args.steps, "step_speedup_vs_trl": round(speedup, 2),
        "drivetrain": dt, "trl": trl, "start_accuracy": start_acc,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
