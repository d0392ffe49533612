"""Every benchmark still runs: ``--quick`` (one round, the smallest workload) ends with its
JSON line carrying the ratios it promises, each with its spread. CI never asserts a timing;
a ratio is only checked to be a positive number."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builtin_run import BUILTIN_ADDITION
from rollout_support import vllm_python

ROOT = Path(__file__).resolve().parents[1]

#: benchmark -> (extra arguments, the ratios its last line must carry, seconds allowed)
BENCHMARKS = {
    "cli": ((), ("listing_speedup_vs_import_all",), 300),
    "engine_fsdp": ((), ("overhead_ratio", "packed_mfu_vs_dense", "packing_speedup"), 300),
    "packed_attention": ((), ("speedup_vs_per_document",), 120),
    "plan_table": ((), (), 300),  # a plan on paper: no timing to compare
    "sft": ((), ("speedup_vs_trl", "speedup_vs_trl_default"), 600),
    "grpo": ((), ("step_speedup_vs_trl", "step_speedup_vs_trl_default"), 900),
    "grpo_seeds": ((), ("greedy_delta.min", "log_prob_gap.max"), 600),
    "real_task": ((), ("accuracy_delta_vs_trl", "time_to_trl_reward_ratio"), 600),
    "async_grpo": (
        (),
        (
            "async_speedup_vs_sync",
            "one_step_off_speedup_vs_sync",
            "async_speedup_vs_polled",
            "async_fraction_of_bound.builtin",
            "overlap_bound.gen_heavy",
            "async_fraction_of_bound.gen_heavy",
            "reward_delta_vs_sync.gen_heavy",
            "length_ratio_vs_sync.gen_heavy",
        ),
        900,
    ),
    "dapo": ((), ("dapo_reward_per_token_vs_grpo",), 900),
    "exact_numerics": ((), ("exact_step_time_ratio",), 600),
    "routing_replay": ((), ("log_prob_gap_ratio_on_vs_off", "step_time_ratio_on_vs_off"), 600),
    "shared_prompts": ((), ("generate_speedup", "update_speedup"), 600),
    "rollout": (("--vllm-python", "VLLM"), ("continuous_vs_batch.hf",), 900),
    "rollout_weight_update": (("--vllm-python", "VLLM"), ("vllm_vs_hf",), 900),
    "weight_sync": (
        (),
        tuple(f"speedup_vs_naive.100M.{t}" for t in ("colocated", "broadcast", "disk")),
        600,
    ),
}


#: benchmarks that start from the built-in SFT model: they take the session's (builtin_run.py)
FROM_BUILTIN_SFT = {
    "async_grpo", "dapo", "exact_numerics", "grpo", "grpo_seeds", "rollout", "shared_prompts"
}  # fmt: skip
#: benchmarks whose processes keep deadlines on each other (weight-sync peers, vLLM's update):
#: run alone. The others only run slower beside another test (--quick checks no timing), and
#: the built-in run's group must hold no serial test: its fixture would run alone too.
RUN_ALONE = {"rollout_weight_update", "weight_sync"}
#: ratios that are no speed-up: a difference (any sign), or a time to reach a reward that a
#: proof run's few seconds may never reach (inf)
NOT_POSITIVE_FINITE = {
    "accuracy_delta_vs_trl",
    "time_to_trl_reward_ratio",
    "reward_delta_vs_sync.gen_heavy",
    "greedy_delta.min",
}
#: what is no timing and has no spread: one value over every run (a check, not a ratio)
NO_SPREAD = {"greedy_delta.min", "log_prob_gap.max"}


def _param(name: str) -> object:
    marks = [BUILTIN_ADDITION] if name in FROM_BUILTIN_SFT else []
    marks += [pytest.mark.serial] if name in RUN_ALONE else []
    return pytest.param(name, marks=marks)


def test_every_benchmark_is_listed_here():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    assert scripts - {"timing", "flops", "weight_delta"} == set(BENCHMARKS)  # helpers


@pytest.mark.slow
@pytest.mark.timeout(2400)  # the benchmark's own limit, after the built-in run for the first
@pytest.mark.parametrize("name", [_param(name) for name in sorted(BENCHMARKS)])
def test_benchmark_runs_quick(name, tmp_path, request):
    extra, ratios, limit = BENCHMARKS[name]
    if "VLLM" in extra:
        extra = tuple(vllm_python() if a == "VLLM" else a for a in extra)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    if name in FROM_BUILTIN_SFT:
        env["DRIVETRAIN_CACHE"] = str(request.getfixturevalue("builtin_addition").cache)
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", *extra],
        capture_output=True, text=True, env=env, timeout=limit, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for ratio in ratios:
        assert isinstance(result[ratio], float) and not math.isnan(result[ratio]), result
        if ratio not in NOT_POSITIVE_FINITE:
            assert math.isfinite(result[ratio]) and result[ratio] > 0, result
        if ratio not in NO_SPREAD:
            low, high = result[f"{ratio}_spread"]
            assert low <= result[ratio] <= high, result
