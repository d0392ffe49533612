"""Trainer checkpoints: the engine's state plus the trainer's, verified, published atomically.

Layout under ``<output_dir>/checkpoints``::

    step_00000010/
        engine/                     written by the engine (model, optimizer, scheduler, RNG)
        trainer_state.json          step, engine name, model path, run id
        drivetrain-manifest.json    size and sha256 of every file above (written last)

Each checkpoint is assembled in a staging directory (``.step_00000010.partial``) and renamed
into place, so a directory named ``step_*`` was complete when written; staging leftovers of a
killed run are removed on start and never resumed from. What happened to it afterwards (a
flipped bit, a truncated copy) the manifest finds: a checkpoint is resumed from only once every
file matches it. ``--resume auto`` takes the newest checkpoint that verifies and says which
newer ones it skipped and why; pruning removes only the current run's checkpoints.

A run's checkpoints carry its run id, and ``checkpoints/run_id`` records whose the directory
is. ``--resume auto`` skips a ``step_*`` that is another run's (a symlink out of the output
directory, or another run id): resumed, it would make the next checkpoints carry that run's id,
and pruning would no longer know this run's own (``--resume PATH`` may still take it; the run
keeps its own id).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.runtime.atomic_dir import STAGING_SUFFIX, publish, remove_stale_staging
from drivetrain.runtime.manifest import ManifestError, has_manifest, verify_manifest, write_manifest
from drivetrain.trainer.checkpoint_space import space_checked
from drivetrain.trainer.errors import CheckpointError

STATE_FILE = "trainer_state.json"
ENGINE_DIR = "engine"
PREFIX = "step_"
#: beside the step directories: the run id of the run whose directory this is
RUN_ID_FILE = "run_id"
_STEP_DIR = re.compile(rf"{PREFIX}(\d+)")


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


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

    @property
    def run_id(self) -> str | None:
        return self.state.get("run_id")


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint's state, without checking its files (see :func:`verify_checkpoint`)."""
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path} is not a complete drivetrain checkpoint (no {STATE_FILE})")
    try:
        state = json.loads(state_file.read_text())
        int(state["step"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{state_file} is corrupt: {exc}") from None
    return Checkpoint(path, state)


def verify_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint at ``path`` once every file matches its manifest; :class:`CheckpointError`
    (one line, naming the file) otherwise. Checkpoints written before manifests existed carry
    none and are taken as they are."""
    checkpoint = read_checkpoint(path)
    if has_manifest(path):
        try:
            verify_manifest(path)
        except ManifestError as exc:
            raise CheckpointError(str(exc)) from None
    return checkpoint


def checkpoint_step(path: Path) -> int | None:
    match = _STEP_DIR.fullmatch(path.name)
    return int(match.group(1)) if match and path.is_dir() else None


class CheckpointManager:
    def __init__(
        self, root: Path, *, keep_last: int, writer: bool, run_id: str | None = None
    ) -> None:
        self.root = root
        self.keep_last = keep_last
        self.writer = writer
        #: written into every checkpoint; pruning removes only this run's checkpoints
        self.run_id = run_id or new_run_id()

    def step_dirs(self) -> list[Path]:
        """Every ``step_*`` directory, oldest first (by the step in its name)."""
        if not self.root.is_dir():
            return []
        found = [(step, p) for p in self.root.iterdir() if (step := checkpoint_step(p)) is not None]
        return [p for _step, p in sorted(found)]

    def complete(self) -> list[Checkpoint]:
        """Checkpoints whose state is readable (files not verified), oldest first."""
        found = []
        for path in self.step_dirs():
            try:
                found.append(read_checkpoint(path))
            except CheckpointError:
                continue
        return sorted(found, key=lambda c: c.step)

    def latest(self) -> Checkpoint | None:
        done = self.complete()
        return done[-1] if done else None

    def latest_verified(
        self, skipped: Callable[[Path, str], None], *, run_id: str | None = None
    ) -> Checkpoint | None:
        """The newest checkpoint that verifies and is this run's (``run_id``: the directory's,
        :meth:`recorded_run_id`); ``skipped(path, why)`` for each newer one."""
        for path in reversed(self.step_dirs()):
            if (why := self.outside(path)) is not None:
                skipped(path, why)
                continue
            try:
                found = verify_checkpoint(path)
            except CheckpointError as exc:
                skipped(path, str(exc))
                continue
            if run_id is not None and found.run_id not in (None, run_id):
                skipped(path, f"another run's (run_id {found.run_id}, this run's is {run_id})")
                continue
            return found
        return None

    def outside(self, path: Path) -> str | None:
        """Why ``path``, a step directory, is not in this run's output directory (a symlink
        out of it), or None. Links within the directory (or its checkpoints folder, when that
        is itself a link to other storage) are the run's own."""
        if not path.is_symlink():
            return None
        target = path.resolve()
        homes = (self.root.resolve(), self.root.parent.resolve())
        if any(target == home or home in target.parents for home in homes):
            return None
        return f"a symlink to {target}, outside {self.root.parent}"

    def recorded_run_id(self) -> str | None:
        """Whose directory this is: the run id in :data:`RUN_ID_FILE`; for a directory written
        before that file existed, the run id most of its own step directories (not symlinks)
        carry, the newest one's on a tie; None with neither."""
        try:
            return (self.root / RUN_ID_FILE).read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            pass
        own = [c.run_id for c in reversed(self.complete()) if c.run_id and not c.path.is_symlink()]
        return Counter(own).most_common(1)[0][0] if own else None

    def clean_staging(self) -> list[Path]:
        """Remove what a killed save left behind (call before any rank starts saving)."""
        return remove_stale_staging(self.root) if self.writer else []

    def staging(self, step: int) -> Path:
        """Same on every rank (SPMD ranks must agree on where the engine writes)."""
        return self.root / f".{PREFIX}{step:08d}{STAGING_SUFFIX}"

    def writing(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Around saving step ``step`` (the engine and :meth:`publish`): a full disk is one
        line saying what to free (:mod:`drivetrain.trainer.checkpoint_space`)."""
        newest = self.latest()
        return space_checked(self.staging(step), newest.path if newest else None)

    def step_path(self, step: int) -> Path:
        """Where step ``step``'s checkpoint is published."""
        return self.root / f"{PREFIX}{step:08d}"

    def engine_staging_path(self, step: int) -> str:
        return str(self.staging(step) / ENGINE_DIR)

    def publish(self, step: int, state: Mapping[str, Any]) -> Path | None:
        """After every rank saved the engine into :meth:`engine_staging_path`: write the trainer
        state and the manifest, rename into place, prune this run's old checkpoints. Only the
        writer does anything."""
        if not self.writer:
            return None
        staging = self.staging(step)
        with open(staging / STATE_FILE, "w") as f:
            json.dump({**state, "step": step, "run_id": self.run_id}, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        write_manifest(staging)
        self._record_run_id()
        target = self.step_path(step)
        if target.is_symlink():  # a skipped link to another run's: drop the link, not its files
            target.unlink()
        publish(staging, target)
        ours = [c for c in self.complete() if c.run_id == self.run_id]
        for old in ours[: -self.keep_last]:
            if old.path.is_symlink():
                old.path.unlink()
            else:
                shutil.rmtree(old.path, ignore_errors=True)
        return target

    def _record_run_id(self) -> None:
        path = self.root / RUN_ID_FILE
        with contextlib.suppress(FileNotFoundError, UnicodeDecodeError):
            if path.read_text().strip() == self.run_id:
                return
        temporary = path.with_name(f".{RUN_ID_FILE}.{uuid.uuid4().hex[:8]}")
        temporary.write_text(self.run_id + "\n")
        os.replace(temporary, path)
