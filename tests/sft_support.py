"""Run ``drivetrain sft`` on a tiny model as users do (subprocesses), and read its losses."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from cli_run import run_command
from drivetrain.trainer.builtin.addition import make_rows
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model

#: fp32, fixed seed, a few steps: small enough for two processes on two cores.
SMALL_JOB = (
    "run.batch_size=8",
    "run.max_steps=6",
    "engine.optim.lr=0.003",
    "engine.micro_batch.max_tokens=64",
    "logging.progress=false",
    "logging.tensorboard=false",
    "run.export_hf=false",
)


def make_job(root: Path, *, rows: int = 64) -> list[str]:
    """A tiny model and an addition dataset under ``root``; returns the base overrides."""
    model = build_tiny_chat_model(root / "model")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in make_rows(rows, seed=0)))
    return [f"engine.model.path={model}", f"data.train_path={data}", *SMALL_JOB]


def sft_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env.update(OMP_NUM_THREADS="1", DRIVETRAIN_CACHE=str(root / "cache"), RAY_AUTH_MODE="disabled")
    return env


def sft_command(*args: str, nproc: int = 0) -> list[str]:
    if nproc:
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        return [sys.executable, *launcher, "-m", "drivetrain.trainer", "sft", *args]
    return [sys.executable, "-m", "drivetrain.trainer", "sft", *args]


def run_sft(root: Path, out: Path, *args: str, nproc: int = 0, timeout: float = 300) -> dict:
    """Run to completion; returns the JSON summary the command prints last."""
    cmd = sft_command(f"run.output_dir={out}", *args, nproc=nproc)
    done = run_command(cmd, env=sft_env(root), timeout=timeout)
    assert done.returncode == 0, f"{cmd}\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


#: a four-step job checkpointing every step, all kept: what the checkpoint fault tests resume
CHECKPOINTED_STEPS = ("run.max_steps=4", "run.save_every=1", "run.keep_last=4")


def sft_again(trained: tuple[Path, list[str]], out: Path, *args: str):
    """``drivetrain sft`` of the ``trained`` job (its root and arguments) into ``out``."""
    root, base = trained
    cmd = sft_command(f"run.output_dir={out}", *base, *CHECKPOINTED_STEPS, *args)
    return run_command(cmd, env=sft_env(root), timeout=240)


def step_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:08d}"
