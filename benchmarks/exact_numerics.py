"""What ``numerics=exact`` costs: the built-in GRPO job's step time, exact over default (the
baseline), and the greedy accuracy each reaches.

Both start from the built-in SFT model (trained first when it is not cached, ~3 min) and run
``--steps`` steps of the built-in job (``drivetrain grpo``, float32, one thread); exact adds
``numerics=exact``. A round is one run of each with the same seed (``seed=<round>``), the order
alternating; every run is a fresh process. A run's step time is its loop time (the steps, not
validation or export) over its steps; the ratio is exact's over default's, one per round;
reported: the median with min-max. Each run validates greedily on 200 held-out problems before
and after.

The last line is JSON: ``exact_step_time_ratio`` (goal <= 1.3 on the CPU) and its ``_spread``,
``step_seconds`` (median per mode), ``accuracy_after`` (median greedy exact-match per mode),
``accuracy_before``, ``rollout_log_prob_diff_max`` (the largest per-token gap over every step
of every run, per mode: 0 for exact), ``phase_seconds`` (``<mode>.generate`` and
``<mode>.update_actor``: medians over runs of each run's median step phase), ``rounds``,
``steps``.
Usage: uv run python benchmarks/exact_numerics.py [--pairs N] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from timing import Ratio, add_arguments, order, print_result, rounds_of, run_grpo

MODES = {"default": [], "exact": ["numerics=exact"]}
PHASES = ("generate", "update_actor")


def run(mode: str, steps: int, seed: int, out: Path, val_size: int) -> dict[str, object]:
    """The run's summary line, with its steps' largest log-prob gap."""
    args = [*MODES[mode], f"run.steps={steps}", f"seed={seed}", f"data.val_size={val_size}"]
    job = run_grpo(args, out, mode)
    steps = job.steps("actor/loss")
    gaps = [r["actor/rollout_log_prob_diff_max"] for r in steps]
    # where the time goes: each phase's median over the steps (the first warms up)
    phases = {p: statistics.median(r[f"time/{p}_s"] for r in steps[1:] or steps) for p in PHASES}
    return {**job.summary, "gap_max": max(gaps), "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rounds = rounds_of(args)
    steps = 3 if args.quick else args.steps
    val_size = 8 if args.quick else 200
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    before: dict[str, list[float]] = {m: [] for m in MODES}
    after: dict[str, list[float]] = {m: [] for m in MODES}
    gap: dict[str, float] = dict.fromkeys(MODES, 0.0)
    phases: dict[str, list[float]] = {f"{m}.{p}": [] for m in MODES for p in PHASES}
    with tempfile.TemporaryDirectory(prefix="exact-") as tmp:
        for seed in range(rounds):
            for mode in order(list(MODES), seed):
                summary = run(mode, steps, seed, Path(tmp) / f"{mode}-{seed}", val_size)
                seconds[mode].append(summary["loop_seconds"] / summary["steps"])
                before[mode].append(summary["val_before"]["val/exact_match"])
                after[mode].append(summary["val_after"]["val/exact_match"])
                gap[mode] = max(gap[mode], summary["gap_max"])
                for phase, value in summary["phases"].items():
                    phases[f"{mode}.{phase}"].append(value)
                print(
                    f"round {seed} {mode}: {seconds[mode][-1]:.3f} s/step, greedy accuracy "
                    f"{before[mode][-1]:.3f} -> {after[mode][-1]:.3f}, largest log-prob gap "
                    f"{summary['gap_max']:.3g}",
                    flush=True,
                )
    ratio = Ratio.of(seconds["exact"], seconds["default"])
    print(f"{'exact_step_time_ratio':<36}{ratio}")
    print_result(
        {"exact_step_time_ratio": ratio},
        step_seconds={m: round(statistics.median(v), 4) for m, v in seconds.items()},
        accuracy_before={m: round(statistics.median(v), 4) for m, v in before.items()},
        accuracy_after={m: round(statistics.median(v), 4) for m, v in after.items()},
        rollout_log_prob_diff_max=gap,
        phase_seconds={k: round(statistics.median(v), 4) for k, v in phases.items()},
        rounds=rounds,
        steps=steps,
    )


if __name__ == "__main__":
    main()
