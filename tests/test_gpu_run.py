"""``benchmarks/gpu/run.sh --cpu-smoke``: the GPU run's every step the CPU can take, as a
GPU machine would take it: the workspace's wheels built (``prepare.sh --own-only``) and
installed into a scratch target, the ``gpu`` tests collected (skipped here), the MFU table's
six configurations on a tiny model (and the profile of two), weight sync, the built-in GRPO
job (two steps, from the session's cached SFT model) and its seeds check (one seed, three
steps), and the JSON last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builtin_run import BUILTIN_ADDITION

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(900)
@BUILTIN_ADDITION
def test_the_gpu_run_passes_its_cpu_smoke(tmp_path, builtin_addition):
    wheels = tmp_path / "wheels"
    prepare = ["bash", str(ROOT / "benchmarks/gpu/prepare.sh"), str(wheels), "--own-only"]
    subprocess.run(prepare, check=True, capture_output=True, timeout=300, cwd=ROOT)
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(wheels), "TMPDIR": str(tmp_path),
           "DRIVETRAIN_CACHE": str(builtin_addition.cache), "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--cpu-smoke"],
        capture_output=True, text=True, env=env, timeout=800, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed_steps"] == [] and result["device"] == "cpu"
    assert result["gpu_tests"]["failed"] == 0 and result["gpu_tests"]["skipped"] > 10
    for key in ("dense_mfu", "dense_vs_plain", "packed_vs_dense_mfu"):
        assert isinstance(result[key], float) and result[key] > 0, result
    assert set(result["mfu_table"]) == {
        "plain", "fsdp2_dense", "fsdp2_packed", "fsdp2_compiled", "megatron_dense",
        "megatron_packed",
    }  # fmt: skip
    assert result["compiled_vs_dense"] > 0
    planned = {n for n, row in result["mfu_table"].items() if row.get("planned_gib", 0) > 0}
    assert planned == {"fsdp2_dense", "fsdp2_packed", "megatron_dense", "megatron_packed"}
    assert set(result["mfu_profile"]) == {"plain", "fsdp2_dense"}
    assert all(ops and ops[0]["ms"] > 0 for ops in result["mfu_profile"].values())
    assert result["grpo"]["steps"] == 2
    assert isinstance(result["grpo_greedy_delta_min"], float)  # one seed, three steps
    assert isinstance(result["grpo_log_prob_gap_max"], float)
    assert set(result["grpo_seeds"]["greedy_delta_by_dtype"]) == {"default"}
    assert "/drivetrain-gpu-" in done.stdout  # the wheels' files ran, not the checkout's
