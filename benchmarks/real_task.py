"""A real model on a task nobody here wrote, drivetrain GRPO vs TRL's GRPOTrainer at equal
wall-clock: who gets further in the same time?

The model: SmolLM2-135M-Instruct (``examples/smollm2/prepare.sh``, from its PyPI wheel). The
task: reasoning-gym's ``chain_sum`` as ``examples/reasoning_gym/grpo.yaml`` sets it (two terms
of one or two digits, "Reply with the number only.", the reply's last number scored by
chain_sum's own scorer); the model starts weak, not at zero. Both sides read that recipe:
the same prompts (the environment's train split; each side draws from it its own way), the
same scorer as the reward, group size, prompts per step, max new tokens, learning rate
(constant), KL off, token-mean loss, group-std advantages, clip 0.2, one optimizer step per
batch, grad clip 1, fp32, one process on the CPU. Each trains for the same budget of
training-loop seconds (``--budget``): drivetrain with ``run.max_seconds``, TRL with a callback
that stops it the same way (after the step during which the budget ran out); start-up, model
loading and saving are outside the budget on both sides.

Per round (the sides' order rotating, ``timing.py``): held-out accuracy (greedy, the
environment's 64 val tasks, the share scored 1 by chain_sum's scorer; one evaluator for
both), the sampled-reward curve against training seconds, and the time drivetrain took to
reach TRL's final reward (TRL's mean over its last 3 steps, against drivetrain's 3-step
moving mean; a round where it never does counts its whole budget and more: ``inf``).

JSON keys: ``accuracy_delta_vs_trl`` (drivetrain's held-out accuracy minus TRL's, per round)
and ``time_to_trl_reward_ratio`` (drivetrain's seconds to TRL's final reward / TRL's
seconds), each a median with its spread; the accuracies, steps and final rewards of each side.

Usage: uv run python benchmarks/real_task.py [--budget S] [--pairs N] [--quick] [--model DIR]
(``--quick``: one round, a tiny local model, a 1 s budget: proves it runs).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from timing import Ratio, add_arguments, interleaved, print_result, rounds_of

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "reasoning_gym" / "grpo.yaml"
VAL_TASKS, SEED, SMOOTH = 64, 0, 3


def recipe() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def environment():
    from drivetrain.envs.reasoning_gym.environment import ReasoningGymEnvironment

    return ReasoningGymEnvironment(recipe()["episode"]["options"])


def prompt_of(env, task) -> list[dict]:
    return list(env.episode(task).reset())  # the messages drivetrain's episodes start from


def run_drivetrain(model: Path, out: Path, budget: float, quick: bool) -> dict:
    cmd = [
        sys.executable, "-m", "drivetrain.trainer", "grpo", "-c", str(RECIPE),
        f"actor.model.path={model}", f"run.output_dir={out}", "run.steps=100000",
        f"run.max_seconds={budget}", "run.save_every=0", "data.val_size=1",
        "logging.progress=false", f"seed={SEED}",
    ]  # fmt: skip
    cmd += ["rollout.max_model_len=256", "data.max_prompt_length=128"] if quick else []
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    loop_s = json.loads(done.stdout.strip().splitlines()[-1])["loop_seconds"]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward/mean" in r]
    # each step's phases (time/*), scaled so they add up to the loop's wall clock (what the
    # budget counts: logging and the like between phases included)
    step_s = list(itertools.accumulate(
        sum(v for k, v in r.items() if k.startswith("time/")) for r in rows
    ))  # fmt: skip
    seconds = [s * loop_s / step_s[-1] for s in step_s]
    return {"seconds": seconds, "rewards": [r["reward/mean"] for r in rows], "model": out / "hf"}


def trl_worker(model: Path, out: Path, budget: float) -> None:
    """Runs in a subprocess: TRL's GRPOTrainer on the recipe's task for ``budget`` seconds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    config, env = recipe(), environment()
    prompts, group = config["run"]["prompts_per_step"], config["sampling"]["n"]
    tasks = env.tasks("train", 4096, SEED)
    data = Dataset.from_list([{"prompt": prompt_of(env, t), "task": json.dumps(t)} for t in tasks])

    def reward(completions: list, task: list, **_: object) -> list[float]:
        return [
            env.scored(env.answer_of(c[0]["content"]), json.loads(t))
            for c, t in zip(completions, task, strict=True)
        ]

    stamps: list[float] = []

    class Budget(TrainerCallback):
        """Stops after the step during which the budget ran out, as run.max_seconds does."""

        def on_train_begin(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            stamps.append(time.perf_counter())
            if stamps[-1] - stamps[0] >= budget:
                control.should_training_stop = True
            return control

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    optim = config["actor"]["optim"]
    args = GRPOConfig(
        output_dir=str(out), max_steps=100000, per_device_train_batch_size=prompts * group,
        gradient_accumulation_steps=1, num_generations=group,
        max_completion_length=config["sampling"]["max_new_tokens"],
        learning_rate=optim["lr"], lr_scheduler_type="constant",
        weight_decay=optim["weight_decay"], max_grad_norm=1.0, warmup_steps=0,
        temperature=config["sampling"]["temperature"], beta=0.0, epsilon=0.2, num_iterations=1,
        loss_type="dapo", scale_rewards="group", use_cpu=True, logging_steps=1, report_to=[],
        save_strategy="no", seed=SEED, dataloader_num_workers=0, shuffle_dataset=False,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=policy, reward_funcs=[reward], args=args, train_dataset=data,
        processing_class=tokenizer, callbacks=[Budget()],
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "hf"))
    tokenizer.save_pretrained(str(out / "hf"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    seconds = [b - stamps[0] for b in stamps[1:]]
    (out / "curve.json").write_text(json.dumps({"seconds": seconds, "rewards": rewards}))


def run_trl(model: Path, out: Path, budget: float) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, __file__, "--trl-worker", str(out), "--model", str(model),
           "--budget", str(budget)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return {**json.loads((out / "curve.json").read_text()), "model": out / "hf"}


def accuracy(model_dir: Path) -> float:
    """Greedy held-out accuracy: the share of the val tasks chain_sum's scorer gives 1."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    env = environment()
    tasks = env.tasks("val", VAL_TASKS, SEED)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [
        tokenizer.apply_chat_template(prompt_of(env, t), tokenize=False, add_generation_prompt=True)
        for t in tasks
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(
            **batch, do_sample=False, max_new_tokens=recipe()["sampling"]["max_new_tokens"],
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )  # fmt: skip
    replies = tokenizer.batch_decode(
        out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    scores = [env.scored(env.answer_of(r), t) for r, t in zip(replies, tasks, strict=True)]
    return sum(s >= 1.0 for s in scores) / len(scores)


def smoothed(rewards: list[float]) -> list[float]:
    return [statistics.mean(rewards[max(0, i - SMOOTH + 1) : i + 1]) for i in range(len(rewards))]


def time_to_reach(run: dict, target: float) -> float:
    """Seconds until the run's moving-mean reward first reaches ``target`` (``inf``: never)."""
    for seconds, reward in zip(run["seconds"], smoothed(run["rewards"]), strict=True):
        if reward >= target:
            return seconds
    return math.inf


def quick_model(root: Path) -> Path:
    from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

    return build_tiny_chat_model(root / "tiny-model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--budget", type=float, default=240.0, help="training seconds a side")
    parser.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--trl-worker")
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(Path(args.model), Path(args.trl_worker), args.budget)
        return
    rounds = rounds_of(args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model, budget = Path(args.model), args.budget
        if args.quick:
            model, budget = quick_model(Path(tmp)), 1.0
        elif not (model / "config.json").exists():
            raise SystemExit(f"no model at {model}: run bash examples/smollm2/prepare.sh first")
        runs: dict[str, list[dict]] = {"drivetrain": [], "trl": []}

        def side(name: str) -> None:
            out = Path(tmp) / f"{name}-{len(runs[name])}"
            if name == "drivetrain":
                runs[name].append(run_drivetrain(model, out, budget, args.quick))
            else:
                runs[name].append(run_trl(model, out, budget))

        sides = {name: lambda n=name: side(n) for name in runs}
        interleaved(sides, rounds, warmup=0)
        start = accuracy(model)
        for run in itertools.chain(*runs.values()):
            run["accuracy"] = accuracy(run.pop("model"))
    deltas, reach = [], []
    for ours, theirs in zip(runs["drivetrain"], runs["trl"], strict=True):
        deltas.append(ours["accuracy"] - theirs["accuracy"])
        target = statistics.mean(theirs["rewards"][-SMOOTH:])
        reach.append(time_to_reach(ours, target) / theirs["seconds"][-1])
    ratios = {"accuracy_delta_vs_trl": Ratio(tuple(deltas)),
              "time_to_trl_reward_ratio": Ratio(tuple(reach))}  # fmt: skip
    table = {
        name: {
            "accuracy": [round(r["accuracy"], 4) for r in rs],
            "steps": [len(r["rewards"]) for r in rs],
            "final_reward": [round(statistics.mean(r["rewards"][-SMOOTH:]), 4) for r in rs],
            "seconds": [round(r["seconds"][-1], 1) for r in rs],
        }
        for name, rs in runs.items()
    }
    print(f"{model.name} on reasoning-gym chain_sum, {budget:g} s of training a side, "
          f"{rounds} rounds; held-out accuracy before: {start:.1%}")  # fmt: skip
    print(f"{'':12}{'accuracy':>22}{'steps':>16}{'final reward':>26}")
    for name, row in table.items():
        print(f"{name:12}{row['accuracy']!s:>22}{row['steps']!s:>16}{row['final_reward']!s:>26}")
    for name, ratio in ratios.items():
        print(f"{name:<28}{ratio}")
    curves = {
        name: {"seconds": [round(x, 1) for x in rs[-1]["seconds"]],
               "rewards": [round(x, 4) for x in rs[-1]["rewards"]]}
        for name, rs in runs.items()
    }  # fmt: skip
    print_result(ratios, budget_s=budget, rounds=rounds, start_accuracy=start, **table,
                 last_round_curves=curves)  # fmt: skip


if __name__ == "__main__":
    main()
