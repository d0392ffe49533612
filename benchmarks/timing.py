"""Interleaved timing, the one way every benchmark here compares configurations.

This machine is shared: a burst of load from another process lasts seconds and lands on
whatever runs then. Timing configuration A for a while and then B puts a burst on one side
and the ratio swings (``engine_fsdp.py`` once printed 0.246 and then 2.212). So every
benchmark runs its configurations in rounds, A B, then B A (three or more rotate: A B C,
B C A, C A B), after untimed warm-up rounds, and takes one ratio per round: a burst spoils
one ratio, and the median of at least 5 rounds ignores it. The spread (min-max over rounds)
says how far to trust the median.

A benchmark's JSON last line carries each ratio under its name as the median (a number, so
checks that read it keep working) and ``<name>_spread: [min, max]``.

``--quick`` (CI runs it) does one round and no warm-up: it proves the benchmark runs; its
numbers mean nothing and CI never asserts one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MIN_PAIRS = 5


@dataclass(frozen=True)
class Ratio:
    """One ratio per round of interleaved runs (or one difference: a reward delta)."""

    values: tuple[float, ...]

    @classmethod
    def of(cls, numerators: Sequence[float], denominators: Sequence[float]) -> Ratio:
        """Round by round ``numerators[i] / denominators[i]`` (e.g. ours/theirs tokens/s)."""
        if len(numerators) != len(denominators) or not numerators:
            raise ValueError(f"rounds differ: {len(numerators)} vs {len(denominators)}")
        return cls(tuple(n / d for n, d in zip(numerators, denominators, strict=True)))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def spread(self) -> list[float]:
        return [min(self.values), max(self.values)]

    def __str__(self) -> str:
        low, high = self.spread
        return f"{self.median:.3f} [{low:.3f}, {high:.3f}]"


@dataclass(frozen=True)
class Measured:
    """What a side returns when it timed its own work (a subprocess's training loop, without
    its start-up); any other return value is ignored and the wall clock times the call."""

    seconds: float


def add_arguments(parser: argparse.ArgumentParser, pairs: int = MIN_PAIRS) -> None:
    """``--pairs N`` (rounds timed, at least 5) and ``--quick`` (one round: proves it runs)."""
    parser.add_argument(
        "--pairs", type=int, default=max(pairs, MIN_PAIRS),
        help=f"timed rounds of interleaved runs (at least {MIN_PAIRS})",
    )  # fmt: skip
    parser.add_argument(
        "--quick", action="store_true",
        help="one round, smallest workload: proves the benchmark runs",
    )  # fmt: skip


def rounds_of(args: argparse.Namespace) -> int:
    """The rounds to time: 1 under ``--quick``; otherwise ``--pairs``, refused below 5."""
    if args.quick:
        return PROOF_ROUNDS
    if args.pairs < MIN_PAIRS:
        raise SystemExit(f"--pairs {args.pairs}: a result needs at least {MIN_PAIRS} rounds")
    return args.pairs


def order(names: Sequence[str], round_index: int) -> list[str]:
    """The names rotated by the round: A B / B A, or A B C / B C A / C A B."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


#: the rounds of a proof run (``--quick``): its numbers are not read, so nothing warms up
PROOF_ROUNDS = 1


def warmup_rounds(rounds: int, warmup: int) -> int:
    """The warm-up rounds to run before ``rounds`` timed ones: none for a proof run."""
    return 0 if rounds == PROOF_ROUNDS else warmup


def interleaved(
    sides: Mapping[str, Callable[[], object]],
    rounds: int,
    warmup: int = 1,
    *,
    progress: Callable[[int, dict[str, float], bool], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each side in each timed round, the sides' order rotating every round.

    A side runs one unit of work, timed by the wall clock here unless it returns
    :class:`Measured`.
    ``warmup`` rounds run first and are not kept (none in a proof run: :func:`warmup_rounds`);
    ``progress(index, seconds, timed)`` sees every round, warm-up ones with ``timed`` false."""
    warmup = warmup_rounds(rounds, warmup)
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        this_round: dict[str, float] = {}
        for name in order(names, index):
            start = time.perf_counter()
            done = sides[name]()
            elapsed = time.perf_counter() - start
            this_round[name] = done.seconds if isinstance(done, Measured) else elapsed
        if index >= warmup:
            for name in names:
                times[name].append(this_round[name])
        if progress is not None:
            progress(index, this_round, index >= warmup)
    return times


def speedup(times: Mapping[str, list[float]], ours: str, baseline: str) -> Ratio:
    """Per round, ``baseline`` seconds / ``ours`` seconds for the same work (> 1: ours faster)."""
    return Ratio.of(times[baseline], times[ours])


def rates(work: float, seconds: Sequence[float]) -> list[float]:
    """Work per second in each round."""
    return [work / s for s in seconds]


def ratio_fields(ratios: Mapping[str, Ratio], digits: int = 3) -> dict[str, object]:
    """``{name: median, name_spread: [min, max]}`` for each ratio, rounded."""
    out: dict[str, object] = {}
    for name, ratio in ratios.items():
        out[name] = round(ratio.median, digits)
        out[f"{name}_spread"] = [round(x, digits) for x in ratio.spread]
    return out


def print_result(ratios: Mapping[str, Ratio], **fields: object) -> dict[str, object]:
    """Print the JSON last line: the ratios (median and spread), then ``fields``."""
    result = {**ratio_fields(ratios), **fields}
    print(json.dumps(result), flush=True)
    return result


@dataclass(frozen=True)
class JobRun:
    """A finished ``drivetrain`` job: its summary (the JSON last line) and metric rows."""

    summary: dict[str, Any]
    rows: list[dict[str, Any]]

    def steps(self, key: str) -> list[dict[str, Any]]:
        """The rows that carry ``key`` (one per step for a per-step metric)."""
        return [r for r in self.rows if key in r]


def run_grpo(args: Sequence[str], out: Path, what: str) -> JobRun:
    """``drivetrain grpo *args`` in a fresh process on one thread, writing ``out``, without
    checkpoints, export or TensorBoard; a failure ends the benchmark naming ``what``."""
    command = [
        sys.executable, "-m", "drivetrain.trainer", "grpo", *args, f"run.output_dir={out}",
        "run.save_every=0", "run.export_hf=false", "logging.progress=false",
        "logging.tensorboard=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return JobRun(json.loads(done.stdout.strip().splitlines()[-1]), rows)
