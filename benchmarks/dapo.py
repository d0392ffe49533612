"""DAPO vs plain GRPO (the baseline) on the built-in GRPO task, at the same generated-token
budget: how much verifier reward each generated token buys, and how many groups carry no
signal.

Both start from the built-in SFT model (trained first when it is not cached, ~3 min) and run
``--steps`` steps; DAPO is ``--preset dapo`` (dynamic sampling, clip-higher, token-level
loss, overlong shaping), GRPO the built-in defaults. A round is one run of each with the same
seed (``seed=<round>``), the order alternating; every run is a fresh process.

Budget: each round's is the smaller of the two runs' generated tokens (DAPO generates more per
step: dynamic sampling's extra rounds, discarded groups included). A run's
``reward_per_token`` is the verifier's reward (``reward/exact_match``, every generated sample,
discarded ones included) summed over its first ``budget`` generated tokens (the step that
crosses the budget counted pro rata), divided by the budget. The ratio is DAPO's over GRPO's,
one per round; reported: the median with min-max.

The last line is JSON: ``dapo_reward_per_token_vs_grpo`` (goal >= 1.0) and its ``_spread``,
``reward_per_token`` (median per method), ``zero_variance_frac_grpo`` and
``zero_variance_frac_dapo`` (each run's mean share of generated groups whose samples all got
the same reward; median and spread over rounds), ``steps_in_budget`` (median steps each
method ran within the budget), ``rounds``, ``steps``.
Usage: uv run python benchmarks/dapo.py [--pairs N] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from timing import Ratio, add_arguments, order, print_result, ratio_fields, rounds_of, run_grpo

METHODS = {"grpo": [], "dapo": ["--preset", "dapo"]}


def run(method: str, steps: int, seed: int, out: Path) -> list[dict[str, float]]:
    """The run's per-step metrics."""
    args = [*METHODS[method], f"run.steps={steps}", f"seed={seed}", "data.val_size=1"]
    return run_grpo(args, out, method).steps("sampling/generated_tokens")


def tokens(steps: list[dict[str, float]]) -> float:
    return sum(s["sampling/generated_tokens"] for s in steps)


def within_budget(steps: list[dict[str, float]], budget: float) -> tuple[float, float]:
    """Reward per generated token over the first ``budget`` tokens, and the steps that took
    (the crossing step as a fraction)."""
    reward, used, taken = 0.0, 0.0, 0.0
    for s in steps:
        step_tokens = s["sampling/generated_tokens"]
        share = min(1.0, (budget - used) / step_tokens)
        if share <= 0:
            break
        reward += share * s["reward/exact_match"] * s["sampling/generated_samples"]
        used += share * step_tokens
        taken += share
    return reward / used, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    rounds = rounds_of(args)
    steps = 4 if args.quick else args.steps
    per_token: dict[str, list[float]] = {m: [] for m in METHODS}
    in_budget: dict[str, list[float]] = {m: [] for m in METHODS}
    zero: dict[str, list[float]] = {m: [] for m in METHODS}
    with tempfile.TemporaryDirectory(prefix="dapo-") as tmp:
        for seed in range(rounds):
            runs = {}
            for method in order(list(METHODS), seed):
                runs[method] = run(method, steps, seed, Path(tmp) / f"{method}-{seed}")
            budget = min(tokens(r) for r in runs.values())
            for method, metrics in runs.items():
                value, taken = within_budget(metrics, budget)
                per_token[method].append(value)
                in_budget[method].append(taken)
                zero[method].append(
                    statistics.mean(s["sampling/zero_variance_frac"] for s in metrics)
                )
                print(
                    f"round {seed} {method}: {value:.5f} reward per token over {budget:.0f} "
                    f"tokens ({taken:.1f} steps), zero-variance groups {zero[method][-1]:.1%}",
                    flush=True,
                )
    ratio = Ratio.of(per_token["dapo"], per_token["grpo"])
    print(f"{'dapo_reward_per_token_vs_grpo':<36}{ratio}")
    print_result(
        {"dapo_reward_per_token_vs_grpo": ratio},
        reward_per_token={m: round(statistics.median(v), 5) for m, v in per_token.items()},
        **ratio_fields({f"zero_variance_frac_{m}": Ratio(tuple(v)) for m, v in zero.items()}),
        steps_in_budget={m: round(statistics.median(v), 1) for m, v in in_budget.items()},
        rounds=rounds,
        steps=steps,
    )


if __name__ == "__main__":
    main()
