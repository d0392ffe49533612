"""The README's main job, run once for every test that reads it.

`drivetrain grpo` with no arguments on an empty cache trains the SFT default first
(`drivetrain sft`'s job, into ``runs/sft-addition``), then GRPO. The SFT and GRPO default tests
check this one run; the DPO and distillation defaults and the benchmarks start from its cached
SFT model instead of training it again (3 minutes each). conftest.py's ``builtin_addition``
fixture runs it; tests that use it carry ``BUILTIN_ADDITION`` so that one xdist worker runs
them all (a session fixture is per worker)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from cli_run import run_cli
from sft_support import sft_env

BUILTIN_ADDITION = pytest.mark.xdist_group("builtin-addition")
GRPO_OUT = "grpo"


@dataclass(frozen=True)
class BuiltinRun:
    cwd: Path  # the run's working directory and DRIVETRAIN_CACHE's parent (sft_env)
    done: subprocess.CompletedProcess[str]

    @property
    def cache(self) -> Path:
        """DRIVETRAIN_CACHE: the assets and the cached SFT model."""
        return self.cwd / "cache"

    @property
    def out(self) -> Path:
        """The GRPO run's output directory."""
        return self.cwd / GRPO_OUT

    @property
    def sft_out(self) -> Path:
        return self.cwd / "runs" / "sft-addition"

    def env(self) -> dict[str, str]:
        """The environment of a job that starts from this run's cached SFT model."""
        return sft_env(self.cwd)


def run_builtin_grpo(root: Path) -> BuiltinRun:
    # in root: the chained SFT run writes runs/sft-addition there
    done = run_cli(
        "grpo", f"run.output_dir={root / GRPO_OUT}", env=sft_env(root), cwd=root, timeout=1400
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return BuiltinRun(cwd=root, done=done)
