"""GRPO ahead of training vs the sync loop (the baseline): the built-in task, trainer and
rollout each in its own process (``rollout.python``: the hf rollout in a server process), one
torch thread each, the same prompts, samples and steps in every mode.

Modes: ``sync`` (generate, train, sync weights), ``one_step_off`` and ``async``
(``max_staleness=1``, partial rollouts resumed, TIS), and ``async_background``: async with the
rollout generating on a thread of its own in its server process, polled every 20 ms
(``algorithm.ahead.background_generation=true``). Runs are interleaved (``timing.py``: the
mode order rotates every round, at least 5 rounds; every run is a fresh process, so there is
no warm-up round); each round gives one ratio per mode (sync seconds / mode seconds, the
training loop's wall-clock: the summary's ``loop_seconds``; validation before and after and
the final checkpoint cost the same in every mode and are left out) and one reward delta (mode
minus sync, mean sampled reward of the last 10 steps). Reported: medians with min-max. The
built-in SFT model is trained first when it is not cached (`drivetrain sft`, ~3 min).

``overlap_bound`` is what hiding generation entirely behind training could give: a sync
run's loop seconds over the same minus its generation seconds (``time/generate_s``). No mode
can beat it on this workload; where generation is a small part of the step, it is small.
``async_fraction_of_bound.builtin`` is, round by round, async's speed-up over that round's
bound (goal >= 0.9): how much of what can be hidden async hides.

The last line is JSON: ``seconds`` (median loop seconds per mode), ``run_seconds`` (median
whole-run seconds), ``async_speedup_vs_sync`` (goal >= 1.6), ``async_speedup_spread``,
``one_step_off_speedup_vs_sync``, ``async_background_speedup_vs_sync``,
``async_background_speedup_vs_async``, ``overlap_bound``, ``async_fraction_of_bound.builtin``,
``reward_delta_vs_sync`` (async; goal
>= -0.02), ``one_step_off_reward_delta_vs_sync`` (each with its ``_spread``), ``rounds``,
``steps``.
Usage: uv run python benchmarks/async_grpo.py [--pairs N] [--steps N] [--quick]
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

from timing import (
    Measured,
    Ratio,
    add_arguments,
    interleaved,
    print_result,
    ratio_fields,
    rounds_of,
    speedup,
)

ASYNC = ["algorithm.mode=async", "algorithm.ahead.max_staleness=1"]
MODES = {
    "sync": [],
    "one_step_off": ["algorithm.mode=one_step_off"],
    "async": ASYNC,
    # the rollout generating on its own thread in its server process, polled every 20 ms
    "async_background": [*ASYNC, "algorithm.ahead.background_generation=true"],
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    rounds = rounds_of(args)
    steps = 4 if args.quick else args.steps  # --quick proves it runs (CI), 4 steps suffice
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}

    def side(mode: str, tmp: Path) -> Measured:
        result = run(mode, steps, tmp / f"{mode}-{len(results[mode])}")
        results[mode].append(result)
        print(f"{mode}: loop {result['seconds']:.2f} s (run {result['run_seconds']:.1f} s), "
              f"reward of the last 10 steps {result['reward_last10']:.3f}", flush=True)  # fmt: skip
        return Measured(result["seconds"])

    with tempfile.TemporaryDirectory(prefix="async-grpo-") as tmp:
        sides = {mode: lambda m=mode: side(m, Path(tmp)) for mode in MODES}
        times = interleaved(sides, rounds, warmup=0)  # fresh processes: nothing to warm
    sync = results["sync"]
    bounds = [r["seconds"] / max(r["seconds"] - r["generate_seconds"], 1e-9) for r in sync]
    ratios = {"overlap_bound": Ratio(tuple(bounds))}
    deltas = {}
    for mode in ("async", "one_step_off", "async_background"):
        ratios[f"{mode}_speedup_vs_sync"] = speedup(times, mode, "sync")
        key = "reward_delta_vs_sync" if mode == "async" else f"{mode}_reward_delta_vs_sync"
        pairs = zip(sync, results[mode], strict=True)
        deltas[key] = Ratio(tuple(r["reward_last10"] - s["reward_last10"] for s, r in pairs))
    async_speedup = ratios["async_speedup_vs_sync"].values
    ratios["async_fraction_of_bound.builtin"] = Ratio.of(async_speedup, bounds)
    ratios["async_background_speedup_vs_async"] = speedup(times, "async_background", "async")
    for name, ratio in {**ratios, **deltas}.items():
        print(f"{name:<36}{ratio}")
    print_result(
        ratios,
        **ratio_fields(deltas, digits=4),
        seconds={m: round(statistics.median(times[m]), 2) for m in MODES},
        run_seconds={
            m: round(statistics.median(r["run_seconds"] for r in results[m]), 2) for m in MODES
        },
        rounds=rounds,
        steps=steps,
    )


if __name__ == "__main__":
    main()
