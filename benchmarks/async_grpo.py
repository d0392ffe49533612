"""GRPO ahead of training vs the sync loop (the baseline): the built-in task, trainer and
rollout each in its own process (``rollout.python``: the hf rollout in a server process), one
torch thread each, the same prompts, samples and steps in every mode.

Modes: ``sync`` (generate, train, sync weights), ``one_step_off`` and ``async``
(``max_staleness=1``, partial rollouts resumed, TIS). Runs are interleaved (the mode order
rotates every repeat) and repeated; each repeat gives one ratio per mode (sync seconds / mode
seconds, the training loop's wall-clock: the summary's ``loop_seconds``; validation before
and after and the final checkpoint cost the same in every mode and are left out) and one
reward delta (mode minus sync, mean sampled reward of the last 10 steps). Reported: medians
with min-max. The built-in SFT model is trained first when it is not cached (`drivetrain
sft`, ~3 min).

``overlap_bound`` is what hiding generation entirely behind training could give: a sync
run's loop seconds over the same minus its generation seconds (``time/generate_s``). No mode
can beat it on this workload; where generation is a small part of the step, it is small.

The last line is JSON: ``seconds`` (median loop seconds per mode), ``run_seconds`` (median
whole-run seconds), ``async_speedup_vs_sync`` (goal >= 1.6), ``async_speedup_spread``,
``one_step_off_speedup_vs_sync``, ``overlap_bound``, ``reward_delta_vs_sync`` (async; goal
>= -0.02), ``one_step_off_reward_delta_vs_sync``, ``repeats``, ``steps``.
Usage: uv run python benchmarks/async_grpo.py [--repeats N] [--steps N] [--quick]
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

MODES = {
    "sync": [],
    "one_step_off": ["algorithm.mode=one_step_off"],
    "async": ["algorithm.mode=async", "algorithm.max_staleness=1"],
}


def run(mode: str, steps: int, out: Path) -> dict[str, float]:
    args = [
        sys.executable, "-m", "drivetrain.trainer", "grpo", *MODES[mode],
        f"run.steps={steps}", f"run.output_dir={out}", f"rollout.python={sys.executable}",
        "run.save_every=0", "run.export_hf=false", "logging.progress=false",
        "logging.tensorboard=false", "data.val_size=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return {
        "seconds": summary["loop_seconds"],
        "run_seconds": summary["seconds"],
        "generate_seconds": sum(r.get("time/generate_s", 0.0) for r in rows),
        "reward_last10": statistics.mean(rewards[-10:]),
    }


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 3), round(max(values), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--quick", action="store_true", help="1 repeat of 20 steps")
    args = parser.parse_args()
    repeats, steps = (1, 20) if args.quick else (args.repeats, args.steps)
    names = list(MODES)
    results: dict[str, list[dict[str, float]]] = {m: [] for m in names}
    with tempfile.TemporaryDirectory(prefix="async-grpo-") as tmp:
        for repeat in range(repeats):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for mode in order:
                result = run(mode, steps, Path(tmp) / f"{mode}-{repeat}")
                results[mode].append(result)
                print(f"repeat {repeat} {mode}: loop {result['seconds']:.2f} s (run "
                      f"{result['run_seconds']:.1f} s), reward of the last 10 steps "
                      f"{result['reward_last10']:.3f}", flush=True)  # fmt: skip
    sync = results["sync"]
    bounds = [r["seconds"] / max(r["seconds"] - r["generate_seconds"], 1e-9) for r in sync]
    out: dict[str, object] = {
        "seconds": {
            m: round(statistics.median(r["seconds"] for r in results[m]), 2) for m in names
        },
        "run_seconds": {
            m: round(statistics.median(r["run_seconds"] for r in results[m]), 2) for m in names
        },
        "overlap_bound": round(statistics.median(bounds), 3),
        "overlap_bound_spread": spread(bounds),
        "repeats": repeats,
        "steps": steps,
    }
    for mode, prefix in (("async", "async"), ("one_step_off", "one_step_off")):
        ratios = [s["seconds"] / r["seconds"] for s, r in zip(sync, results[mode], strict=True)]
        deltas = [r["reward_last10"] - s["reward_last10"] for s, r in zip(sync, results[mode],
                                                                         strict=True)]  # fmt: skip
        out[f"{prefix}_speedup_vs_sync"] = round(statistics.median(ratios), 3)
        out[f"{prefix}_speedup_spread"] = spread(ratios)
        key = "reward_delta_vs_sync" if mode == "async" else f"{prefix}_reward_delta_vs_sync"
        out[key] = round(statistics.median(deltas), 4)
        out[f"{prefix}_reward_delta_spread"] = spread(deltas)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
