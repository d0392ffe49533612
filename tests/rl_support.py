"""Run ``drivetrain grpo`` / ``drivetrain ppo`` on a tiny model as users do (subprocesses)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cli_run import run_cli
from drivetrain.trainer.builtin.addition import make_rows
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

#: fp32, fixed seeds, a few prompts: small enough for three processes on two cores.
SMALL_RL = (
    "run.prompts_per_step=4",
    "sampling.n=4",
    "sampling.max_new_tokens=6",
    "actor.optim.lr=0.001",
    "critic.optim.lr=0.001",
    "data.val_size=8",
    "logging.progress=false",
    "logging.tensorboard=false",
    "run.export_hf=false",
    "weight_sync.verify=true",
)


def make_rl_job(root: Path, *, rows: int = 32) -> list[str]:
    model = build_tiny_chat_model(root / "model")
    for name, seed in (("train", 0), ("val", 1)):
        (root / f"{name}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in make_rows(rows, seed=seed))
        )
    return [
        f"actor.model.path={model}",
        f"data.train_path={root / 'train.jsonl'}",
        f"data.val_path={root / 'val.jsonl'}",
        *SMALL_RL,
    ]


def varied_reward(response: str, ground_truth: str) -> float:
    """A reward that differs between a random model's samples (``rl_support:varied_reward``),
    so advantages, and with them the updates, are not all zero."""
    return (sum(map(ord, response)) % 5) / 4


def rl_command(algorithm: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "drivetrain.trainer", algorithm, *args]


def run_rl(
    algorithm: str, *args: str, env: dict[str, str], timeout: float = 600
) -> tuple[dict[str, Any], subprocess.CompletedProcess]:
    done = run_cli(algorithm, *args, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def metrics_rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_async_steps(
    out: Path,
    rows: list[dict[str, Any]],
    max_staleness: int,
    *,
    group_size: int = 4,
    from_first_token: bool = False,
) -> None:
    """An async run's trained samples, recounted from ``samples.jsonl`` (each sample's
    ``[first, last]`` weight version and the trainer's version, groups of ``group_size`` in
    a row): one log row per step, no sample ahead of the trainer, no group more than
    ``max_staleness`` versions behind it (counted from its last token, the default rule, or
    from every sample's first), the trainer's version moving with the steps, and the
    trainer's own staleness, spanning and length-by-staleness metrics agreeing with the
    log."""
    logged = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [row["step"] for row in logged] == [r["step"] for r in rows]
    assert [row["trainer_version"] for row in logged] == [r["step"] - 1 for r in rows]
    for row, metrics in zip(logged, rows, strict=True):
        versions, now = row["versions"], row["trainer_version"]
        assert versions and len(versions) % group_size == 0, row
        lags = [now - low for low, _ in versions]
        assert all(low <= high <= now for low, high in versions), row
        assert min(lags) >= 0 and max(lags) == metrics["async/staleness_max"]
        groups = [versions[i : i + group_size] for i in range(0, len(versions), group_size)]
        if from_first_token:
            assert max(lags) <= max_staleness, row
        else:
            assert all(now - max(h for _, h in g) <= max_staleness for g in groups), row
        spanning = sum(low < high for low, high in versions) / len(versions)
        assert spanning == pytest.approx(metrics["async/partial_samples_frac"])
        by_lag = {k for k in metrics if k.startswith("async/length_by_staleness/")}
        assert by_lag == {f"async/length_by_staleness/{lag}" for lag in lags}


def kill_mid_run(
    args: list[str],
    out: Path,
    env: dict[str, str],
    victim: Callable[[int], int],
    sig: signal.Signals = signal.SIGKILL,
) -> tuple[float, str]:
    """Start ``drivetrain grpo args``; once step 2's checkpoint exists, send ``sig`` (SIGKILL;
    SIGSTOP leaves it alive but silent) to the process ``victim(run_pid)`` names and wait for
    the run to fail. Returns the seconds from the signal to the run's exit, and its stderr."""
    proc = subprocess.Popen(
        rl_command("grpo", *args), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        while not list((out / "checkpoints").glob("step_00000002")):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint of step 2"
            time.sleep(0.05)
        os.kill(victim(proc.pid), sig)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=180)
        assert proc.returncode not in (0, None), "the run survived the kill"
        return time.monotonic() - killed, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
