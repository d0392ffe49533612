"""GRPO ahead of training vs the sync loop (the baseline), on two workloads: trainer and
rollout each in its own process (``rollout.python``: the hf rollout in a server process), one
torch thread each, the same prompts, samples and steps in every mode.

Workloads: ``builtin``, the built-in task (answers of 2-4 tokens: generation is about a quarter
of a step), and ``gen_heavy``, the counting-up task (``builtin/counting_up.py``: the same
problems answered in 2 to 76 tokens, its model fine-tuned from the built-in SFT model first
when not cached, ~3 min): generation dominates, and answer lengths vary per problem and sample.

Modes: ``sync`` (generate, train, sync weights), ``one_step_off`` and ``async``
(``max_staleness=1``, partial rollouts resumed, TIS, the rollout generating on its own in its
server process and polled every 20 ms), ``async_polled``: async with the trainer's poller
driving each token step (``algorithm.ahead.background_generation=false``), and on
``gen_heavy`` ``async_first_token``: async with a group's staleness counted from its first
token (the rule that drops the long answers resumed under newer weights; ``async`` counts from
the last; ``--quick`` runs ``sync`` and ``async`` only there). Runs are interleaved
(``timing.py``: the mode order rotates every round, at least 5 rounds; every run is a fresh
process, so there is no warm-up round); each round gives one ratio per mode (sync seconds /
mode seconds, the training loop's wall-clock: the summary's ``loop_seconds``; validation
before and after and the final checkpoint cost the same in every mode and are left out), one
reward delta (mode minus sync, mean sampled reward of the last 10 steps) and one length ratio
(mode / sync, mean response length trained on, over every step's ``response/length_mean``).
Reported: medians with min-max. The built-in SFT model is trained first when it is not cached
(`drivetrain sft`, ~3 min).

``overlap_bound`` is what hiding generation entirely behind training could give: a sync run's
loop seconds over the same minus its generation seconds (``time/generate_s``), round by round.
No mode can beat it on its workload. ``async_fraction_of_bound.<workload>`` is async's
speed-up over that round's bound (goal >= 0.9): how much of what can be hidden async hides.

The last line is JSON. ``builtin``: ``async_speedup_vs_sync``, ``one_step_off_speedup_vs_sync``,
``async_polled_speedup_vs_sync``, ``async_speedup_vs_polled``, ``overlap_bound``,
``async_fraction_of_bound.builtin``, ``reward_delta_vs_sync`` (async; goal >= -0.02),
``one_step_off_reward_delta_vs_sync``, ``async_polled_reward_delta_vs_sync``; ``gen_heavy``:
``overlap_bound.gen_heavy`` (goal >= 1.6), ``async_fraction_of_bound.gen_heavy``,
``speedup_vs_sync.gen_heavy``, ``reward_delta_vs_sync.gen_heavy`` (goal >= -0.02),
``length_ratio_vs_sync.gen_heavy`` (goal within 5% of 1), the last three also for the other
async modes (``….gen_heavy.async_first_token``, ``….gen_heavy.async_polled``) and
``async_speedup_vs_polled.gen_heavy``; each
with its ``_spread``; ``seconds`` and ``gen_heavy_seconds`` (per mode, medians: loop, whole-run and
generation seconds, samples dropped as too stale), ``rounds``, ``steps``, ``gen_heavy_steps``.
Usage: uv run python benchmarks/async_grpo.py [--pairs N] [--steps N] [--gen-heavy-steps N]
[--workload builtin|gen_heavy|both] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
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
    run_grpo,
    speedup,
)

ASYNC = ["algorithm.mode=async", "algorithm.ahead.max_staleness=1"]
BUILTIN_MODES = {
    "sync": [],
    "one_step_off": ["algorithm.mode=one_step_off"],
    "async": ASYNC,
    # the trainer's poller driving every token step of the rollout's server process
    "async_polled": [*ASYNC, "algorithm.ahead.background_generation=false"],
}
#: the generation-heavy workload: the policies on which samples are too stale side by side
GEN_HEAVY_MODES = {
    "sync": [],
    "async": ASYNC,
    "async_first_token": [*ASYNC, "algorithm.ahead.staleness_from=first_token"],
    "async_polled": [*ASYNC, "algorithm.ahead.background_generation=false"],
}
BUILTIN = Path(__file__).resolve().parents[1] / "packages/trainer/src/drivetrain/trainer/builtin"
#: fine-tuning steps of the counting-up model under --quick (it proves the path, learns little)
QUICK_COUNTING_STEPS = 10


def gen_heavy_args(quick: bool) -> list[str]:
    """The counting-up workload (``builtin/counting_up.py``): the built-in GRPO job's settings
    on the counting-up model, answers of up to 76 tokens, reward on the last number."""
    from drivetrain.trainer.builtin import addition, counting_up

    assets = addition.ensure_assets()
    steps = QUICK_COUNTING_STEPS if quick else counting_up.SFT_STEPS
    model = counting_up.ensure_model(assets, steps=steps)
    return [
        "-c", str(BUILTIN / "addition_grpo.yaml"), "-c", str(BUILTIN / "addition_grpo.hf.yaml"),
        f"actor.model.path={model}", f"data.train_path={assets.rl_path}",
        f"data.val_path={assets.test_path}", "reward.functions=[numeric_match]",
        f"sampling.max_new_tokens={counting_up.MAX_ANSWER_CHARS + 1}",
    ]  # fmt: skip


def run(workload: list[str], mode: list[str], steps: int, out: Path) -> dict[str, float]:
    args = [*workload, *mode, f"run.steps={steps}", f"rollout.python={sys.executable}"]
    job = run_grpo([*args, "data.val_size=1"], out, " ".join(mode) or "sync")
    summary, rows = job.summary, job.rows
    rewards = [r["reward/mean"] for r in job.steps("reward/mean")]
    lengths = [r["response/length_mean"] for r in job.steps("response/length_mean")]
    return {
        "seconds": summary["loop_seconds"],
        "run_seconds": summary["seconds"],
        "generate_seconds": sum(r.get("time/generate_s", 0.0) for r in rows),
        "reward_last10": statistics.mean(rewards[-10:]),
        "length_mean": statistics.mean(lengths),  # of the samples trained on, every step
        "dropped_samples": sum(r.get("async/dropped_samples", 0.0) for r in rows),
    }


def measure(
    name: str, workload: list[str], modes: dict[str, list[str]], rounds: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[dict[str, float]]]]:
    """Every mode of ``modes`` on ``workload``, interleaved: loop seconds and each run's
    numbers, per mode."""
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}

    def side(mode: str, tmp: Path) -> Measured:
        result = run(workload, modes[mode], steps, tmp / f"{mode}-{len(results[mode])}")
        results[mode].append(result)
        print(f"{name} {mode}: loop {result['seconds']:.2f} s (run {result['run_seconds']:.1f} "
              f"s), reward of the last 10 steps {result['reward_last10']:.3f}, length "
              f"{result['length_mean']:.1f}, dropped {result['dropped_samples']:.0f}",
              flush=True)  # fmt: skip
        return Measured(result["seconds"])

    with tempfile.TemporaryDirectory(prefix="async-grpo-") as tmp:
        sides = {mode: lambda m=mode: side(m, Path(tmp)) for mode in modes}
        times = interleaved(sides, rounds, warmup=0)  # fresh processes: nothing to warm
    return times, results


def bound_of(sync: list[dict[str, float]]) -> list[float]:
    """Per round: sync's loop seconds over the same without generation."""
    return [r["seconds"] / max(r["seconds"] - r["generate_seconds"], 1e-9) for r in sync]


def deltas_vs_sync(results: dict[str, list[dict[str, float]]], mode: str, key: str) -> Ratio:
    pairs = zip(results["sync"], results[mode], strict=True)
    return Ratio(tuple(r[key] - s[key] for s, r in pairs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--gen-heavy-steps", type=int, default=40)
    parser.add_argument("--workload", choices=("builtin", "gen_heavy", "both"), default="both")
    args = parser.parse_args()
    rounds = rounds_of(args)
    ratios: dict[str, Ratio] = {}
    deltas: dict[str, Ratio] = {}
    fields: dict[str, object] = {"rounds": rounds}
    if args.workload in ("builtin", "both"):
        steps = 4 if args.quick else args.steps  # --quick proves it runs (CI), 4 steps suffice
        times, results = measure("builtin", [], BUILTIN_MODES, rounds, steps)
        bounds = bound_of(results["sync"])
        ratios["overlap_bound"] = Ratio(tuple(bounds))
        for mode in ("async", "one_step_off", "async_polled"):
            ratios[f"{mode}_speedup_vs_sync"] = speedup(times, mode, "sync")
            key = "reward_delta_vs_sync" if mode == "async" else f"{mode}_reward_delta_vs_sync"
            deltas[key] = deltas_vs_sync(results, mode, "reward_last10")
        async_speedup = ratios["async_speedup_vs_sync"].values
        ratios["async_fraction_of_bound.builtin"] = Ratio.of(async_speedup, bounds)
        ratios["async_speedup_vs_polled"] = speedup(times, "async", "async_polled")
        fields |= {"steps": steps, "seconds": medians(times, results)}
    if args.workload in ("gen_heavy", "both"):
        steps = 4 if args.quick else args.gen_heavy_steps
        workload = gen_heavy_args(args.quick)
        # --quick proves the path with the two modes its keys need (CI's time)
        modes = (
            {m: GEN_HEAVY_MODES[m] for m in ("sync", "async")} if args.quick else GEN_HEAVY_MODES
        )
        times, results = measure("gen_heavy", workload, modes, rounds, steps)
        bounds = bound_of(results["sync"])
        ratios["overlap_bound.gen_heavy"] = Ratio(tuple(bounds))
        for mode in [m for m in modes if m != "sync"]:
            suffix = "" if mode == "async" else f".{mode}"
            ratios[f"speedup_vs_sync.gen_heavy{suffix}"] = speedup(times, mode, "sync")
            ratios[f"length_ratio_vs_sync.gen_heavy{suffix}"] = Ratio.of(
                [r["length_mean"] for r in results[mode]],
                [r["length_mean"] for r in results["sync"]],
            )
            deltas[f"reward_delta_vs_sync.gen_heavy{suffix}"] = deltas_vs_sync(
                results, mode, "reward_last10"
            )
        ratios["async_fraction_of_bound.gen_heavy"] = Ratio.of(
            ratios["speedup_vs_sync.gen_heavy"].values, bounds
        )
        if "async_polled" in modes:
            ratios["async_speedup_vs_polled.gen_heavy"] = speedup(times, "async", "async_polled")
        fields |= {"gen_heavy_steps": steps, "gen_heavy_seconds": medians(times, results)}
    for name, ratio in {**ratios, **deltas}.items():
        print(f"{name:<44}{ratio}")
    print_result(ratios, **ratio_fields(deltas, digits=4), **fields)


def medians(
    times: dict[str, list[float]], results: dict[str, list[dict[str, float]]]
) -> dict[str, dict[str, float]]:
    """Median loop and whole-run seconds per mode."""
    return {
        m: {
            "loop": round(statistics.median(times[m]), 2),
            "run": round(statistics.median(r["run_seconds"] for r in results[m]), 2),
            "generate": round(statistics.median(r["generate_seconds"] for r in results[m]), 2),
            "dropped_samples": statistics.median(r["dropped_samples"] for r in results[m]),
        }
        for m in times
    }


if __name__ == "__main__":
    main()
