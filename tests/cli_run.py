"""Run ``drivetrain`` jobs as users do, ``python -m drivetrain.trainer ARGS`` in a process of
their own, without paying its imports each time: the process is forked from a Python that has
imported torch, transformers, the fsdp engine and the hf rollout already
(``drivetrain.testing.torch_engines.zygote``). A tiny SFT job took 13.4 s, 10 of them importing.
``DRIVETRAIN_ZYGOTE=0`` starts fresh processes instead. Jobs under torchrun, Ray's processes,
venvs of their own and signal drills start fresh ones whatever this says."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from drivetrain.testing.torch_engines import zygote_client

#: what a job imports anyway (those installed): forked children start with them
CLI_PRELOAD = (
    "torch",
    "transformers",
    "matplotlib.pyplot",
    "drivetrain.engine.fsdp.engine",
    "drivetrain.rollout.hf.rollout",
    "drivetrain.trainer.cli",
)


def run_cli(
    *args: str,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, "-m", "drivetrain.trainer", *args],
    capture_output=True, text=True, ...)``, forked."""
    argv = ["-m", "drivetrain.trainer", *args]
    return zygote_client.run(argv, preload=CLI_PRELOAD, env=env, cwd=cwd, timeout=timeout)


def run_command(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)``; forked (:func:`run_cli`)
    when ``cmd`` is ``[sys.executable, "-m", "drivetrain.trainer", ...]``."""
    if list(cmd[:3]) == [sys.executable, "-m", "drivetrain.trainer"]:
        return run_cli(*cmd[3:], env=env, cwd=cwd, timeout=timeout)
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
