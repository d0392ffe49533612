"""Does the built-in GRPO job improve its model, whatever the seed and dtype? Greedy held-out
accuracy before and after, and the rollout-vs-trainer log-prob gap, over seeds x dtypes.

Not a timing: a check that the default job (``drivetrain grpo``, its 120 steps, from the built-in
SFT model, trained first when it is not cached) leaves its model better than it found it. One
run per seed and dtype, each a fresh process on one thread (``timing.run_grpo``), one after
the other: a seed's dtypes in turn, their order rotating with the seed. ``float32`` is the
baseline the job was tuned in; ``bfloat16`` sets both the actor (mixed precision: fp32 master
weights) and the rollout; ``default`` passes no dtype (what a user who says nothing gets on
this machine: the GPU run of ``benchmarks/gpu/run.sh`` uses it). A run's greedy delta is its
exact-match accuracy on the 200 held-out problems after GRPO minus before (the job's own
``greedy_delta``); its gap is the job's ``log_prob_gap``: the token-mean gap of its worst step
and its largest single token.

The last line is JSON: ``greedy_delta.min`` over every run (goal > 0), ``greedy_delta.median``,
``greedy_delta.max``, ``greedy_delta_by_dtype`` (each dtype's deltas in seed order);
``log_prob_gap.max`` (the worst step's token mean over every run), ``log_prob_gap.token_max``,
``log_prob_gap_by_dtype`` (the worst per dtype, with its alarm threshold); ``accuracy_before``
/ ``accuracy_after`` (per dtype, seed order), ``seeds``, ``steps``, ``all_rise``.
Usage: uv run python benchmarks/grpo_seeds.py [--seeds 3] [--dtypes float32,bfloat16]
       [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from timing import order, print_result, run_grpo

DTYPES = ("float32", "bfloat16", "default")


def dtype_args(dtype: str) -> list[str]:
    """The job's overrides for ``dtype`` (none for ``default``)."""
    if dtype == "default":
        return []
    return [f"actor.model.dtype={dtype}", f"rollout.dtype={dtype}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1")
    parser.add_argument("--dtypes", default="float32,bfloat16", help=f"of {', '.join(DTYPES)}")
    parser.add_argument("--steps", type=int, default=0, help="0: the job's own (120)")
    parser.add_argument("--quick", action="store_true", help="one seed, 3 steps: proves it runs")
    args = parser.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown or not dtypes or args.seeds < 1:
        parser.error(f"--dtypes takes {', '.join(DTYPES)}; --seeds >= 1 (got {args.dtypes})")
    seeds = 1 if args.quick else args.seeds
    steps = 3 if args.quick else args.steps
    extra = [f"run.steps={steps}"] if steps else []
    extra += ["data.val_size=8"] if args.quick else []
    before: dict[str, list[float]] = {d: [] for d in dtypes}
    after: dict[str, list[float]] = {d: [] for d in dtypes}
    deltas: dict[str, list[float]] = {d: [] for d in dtypes}  # the jobs' own greedy_delta
    gaps: dict[str, dict[str, float]] = {}
    ran_steps = 0
    with tempfile.TemporaryDirectory(prefix="grpo-seeds-") as tmp:
        for seed in range(seeds):
            for dtype in order(dtypes, seed):
                out = Path(tmp) / f"{dtype}-{seed}"
                job = run_grpo([*dtype_args(dtype), f"seed={seed}", *extra], out, dtype)
                summary = job.summary
                ran_steps = summary["steps"]
                gap, delta = summary["log_prob_gap"], summary["greedy_delta"]
                if gap is None or delta is None:
                    raise SystemExit(f"{dtype} seed {seed}: no log-prob gap or greedy change")
                before[dtype].append(summary["val_before"]["val/exact_match"])
                after[dtype].append(summary["val_after"]["val/exact_match"])
                deltas[dtype].append(delta)
                worst = gaps.setdefault(dtype, {"max": 0.0, "token_max": 0.0})
                worst["max"] = max(worst["max"], gap["max"])
                worst["token_max"] = max(worst["token_max"], gap["token_max"])
                worst["alarm"] = gap["alarm"]
                print(
                    f"seed {seed} {dtype:>8}: greedy accuracy {before[dtype][-1]:.3f} -> "
                    f"{after[dtype][-1]:.3f} ({delta * 100:+.1f} points); "
                    f"log-prob gap {gap['mean']:.3g} mean, {gap['max']:.3g} worst step, "
                    f"{gap['token_max']:.3g} largest token (alarm {gap['alarm']:g})",
                    flush=True,
                )
    every = [x for values in deltas.values() for x in values]
    print(f"greedy accuracy change over {len(every)} runs: min {min(every) * 100:+.1f} points")
    worst = max(gaps.values(), key=lambda g: g["max"])
    print_result(
        {},
        **{
            "greedy_delta.min": min(every),
            "greedy_delta.median": statistics.median(every),
            "greedy_delta.max": max(every),
            "log_prob_gap.max": worst["max"],
            "log_prob_gap.token_max": max(g["token_max"] for g in gaps.values()),
        },
        greedy_delta_by_dtype=deltas,
        log_prob_gap_by_dtype=gaps,
        accuracy_before=before,
        accuracy_after=after,
        all_rise=min(every) > 0,
        seeds=seeds,
        steps=ran_steps,
    )


if __name__ == "__main__":
    main()
