"""Trainer checkpoints: the engine's state plus the trainer's, published atomically.

Layout under ``<output_dir>/checkpoints``::

    step_00000010/
        engine/              written by the engine (model, optimizer, scheduler, RNG)
        trainer_state.json   step, engine name, model path (written last, before the rename)

Each checkpoint is assembled in a staging directory (``.step_00000010.partial``) and renamed
into place, so a directory named ``step_*`` is always complete; staging leftovers of a killed
run are removed on start and never resumed from.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api.atomic_dir import STAGING_SUFFIX, publish, remove_stale_staging
from drivetrain.trainer.errors import CheckpointError

STATE_FILE = "trainer_state.json"
ENGINE_DIR = "engine"
PREFIX = "step_"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: Mapping[str, Any]

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def engine_path(self) -> str:
        return str(self.path / ENGINE_DIR)


def read_checkpoint(path: Path) -> Checkpoint:
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete drivetrain checkpoint (no {STATE_FILE})")
    try:
        return Checkpoint(path, json.loads(state_file.read_text()))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{state_file} is corrupt: {exc}") from None


class CheckpointManager:
    def __init__(self, root: Path, *, keep_last: int, writer: bool) -> None:
        self.root = root
        self.keep_last = keep_last
        self.writer = writer

    def complete(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.glob(f"{PREFIX}*"):
            if path.is_dir() and (path / STATE_FILE).is_file():
                found.append(read_checkpoint(path))
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def clean_staging(self) -> list[Path]:
        """Remove what a killed save left behind (call before any rank starts saving)."""
        return remove_stale_staging(self.root) if self.writer else []

    def staging(self, step: int) -> Path:
        """Same on every rank (SPMD ranks must agree on where the engine writes)."""
        return self.root / f".{PREFIX}{step:08d}{STAGING_SUFFIX}"

    def engine_staging_path(self, step: int) -> str:
        return str(self.staging(step) / ENGINE_DIR)

    def publish(self, step: int, state: Mapping[str, Any]) -> Path | None:
        """After every rank saved the engine into :meth:`engine_staging_path`: write the trainer
        state, rename into place, prune old checkpoints. Only the writer does anything."""
        if not self.writer:
            return None
        staging = self.staging(step)
        with open(staging / STATE_FILE, "w") as f:
            json.dump({**state, "step": step}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        target = self.root / f"{PREFIX}{step:08d}"
        publish(staging, target)
        for old in self.complete()[: -self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
        return target
