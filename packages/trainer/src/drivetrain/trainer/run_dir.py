"""Which checkpoint a run starts from, and whose run directory it writes into.

A new run never writes into a directory that holds another run's files: pruning, the metrics
file and ``--resume auto`` would mix the two (an older run's ``step_10`` pruned the new run's
checkpoints as they were written, and was later resumed as if it were the new run's). So:

- ``--resume auto`` continues the newest checkpoint in the directory that verifies and is
  this run's (saying which newer ones it skipped and why: damaged, a symlink out of the
  directory, another run's id); with none, the directory must hold no run;
- ``--resume none`` and ``--resume PATH`` start writing into a directory that holds no run;
- ``--overwrite`` starts a new run in any case, after moving the old directory aside to
  ``<dir>.replaced-<time>`` (never deleting it).

A run keeps the directory's run id (a new one for a new directory) whichever checkpoint it
continues: one resumed from another run's (``--resume PATH``) says so, and the checkpoints it
writes are still this run's, for pruning.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.runtime.atomic_dir import STAGING_SUFFIX
from drivetrain.runtime.manifest import has_manifest
from drivetrain.trainer.checkpoints import Checkpoint, CheckpointManager, verify_checkpoint
from drivetrain.trainer.errors import CheckpointError, NothingToTrain, RunDirectoryError


def adopt_checkpoint(
    found: Checkpoint, state: Mapping[str, Any], checkpoints: CheckpointManager
) -> None:
    """Continue ``found``'s run: every key of this run's ``state`` must match the one the
    checkpoint recorded (else another run.output_dir or --overwrite). Its run id was settled
    by :func:`resume_point`."""
    for key, value in state.items():
        if found.state.get(key) != value:
            raise CheckpointError(
                f"{found.path} has {key}={found.state.get(key)!r}, this run {value!r}; use "
                "another run.output_dir or --overwrite"
            )


def steps_knob(run: Any) -> str:
    """Which option of an SFT or DPO ``run`` section sets its number of steps."""
    return "run.max_steps" if run.max_steps else "run.epochs"


def check_steps_left(found: Checkpoint, total: int, knob: str) -> None:
    """Refuse to resume a run that is already at or past its last step (``total``, set by
    ``knob``): re-validating and re-exporting it would read as a new result."""
    if found.step >= total:
        raise NothingToTrain(
            f"nothing to train: {found.path} is at step {found.step} and {knob} makes {total} "
            "steps; for a new run use another run.output_dir or --overwrite"
        )


def resume_point(
    checkpoints: CheckpointManager, how: str, *, overwrite: bool, console: Console
) -> Checkpoint | None:
    """The verified checkpoint to continue from (``how``: auto, none or a path), or None. One
    without a manifest (written before drivetrain checked its files) is taken with a warning
    naming it; a directory whose every checkpoint is damaged is an error saying why each is.
    Sets ``checkpoints.run_id`` to the directory's (see the module docstring)."""
    if how == "none" or (how == "auto" and overwrite):
        return None
    # --overwrite moves the directory aside: this run's is then a new one
    own = None if overwrite else checkpoints.recorded_run_id()
    checkpoints.run_id = own or checkpoints.run_id
    if how != "auto":
        path = Path(how).absolute()
        if overwrite and checkpoints.root.parent.absolute() in path.parents:
            raise CheckpointError(
                f"--overwrite moves {checkpoints.root.parent} aside, and --resume {how} is in it:"
                " resume from a copy outside it, or drop --overwrite"
            )
        found = _unverified_said(verify_checkpoint(path), console)
        if found.run_id not in (None, checkpoints.run_id):
            console.print(
                f"resuming from another run's checkpoint {found.path} (run_id {found.run_id}); "
                f"this run keeps its own run_id {checkpoints.run_id}"
            )
        return found
    damaged: list[str] = []

    def skipped(path: Path, why: str) -> None:
        console.print(f"skipping checkpoint {path}: {why}")
        damaged.append(f"{path.name}: {why}")

    found = checkpoints.latest_verified(skipped, run_id=own)
    if found is None and damaged:
        raise CheckpointError(
            f"every checkpoint in {checkpoints.root} is damaged or another run's "
            f"({'; '.join(damaged)}): resume from a good copy with --resume PATH, or start "
            "over with --overwrite (which moves this run aside)"
        )
    if found is not None and own is None:  # no run id recorded: continue the checkpoint's
        checkpoints.run_id = found.run_id or checkpoints.run_id
    return found if found is None else _unverified_said(found, console)


def _unverified_said(found: Checkpoint, console: Console) -> Checkpoint:
    if not has_manifest(found.path):
        console.print(
            f"warning: {found.path} has no manifest (written before drivetrain checked its "
            "files): resuming from it unverified"
        )
    return found


def holds_a_run(out: Path) -> bool:
    """Any file below ``out`` but the staging leftovers a killed save leaves (cleaned on start
    by the writer; the other ranks may still see them)."""
    if not out.is_dir():
        return False
    for _root, dirs, files in os.walk(out):
        dirs[:] = [d for d in dirs if not d.endswith(STAGING_SUFFIX)]
        if files:
            return True
    return False


def claim_run_dir(
    out: Path, *, resuming: bool, overwrite: bool, writer: bool, console: Console
) -> None:
    """Before a run writes anything: refuse ``out`` if it holds another run (unless this run
    resumes from it), or move that run aside with ``overwrite``."""
    if resuming and not overwrite:
        return
    if not holds_a_run(out):
        return
    if not overwrite:
        raise RunDirectoryError(
            f"{out} holds another run's files: pick another run.output_dir, continue that run "
            "(--resume auto, when it has a checkpoint), or pass --overwrite to move it aside"
        )
    if writer:
        aside = out.with_name(f"{out.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
        while aside.exists():
            aside = aside.with_name(aside.name + "-1")
        os.replace(out, aside)
        console.print(f"--overwrite: moved the previous run in {out} to {aside}")


def start_point(
    checkpoints: CheckpointManager,
    how: str,
    *,
    overwrite: bool,
    writer: bool,
    console: Console,
) -> Checkpoint | None:
    """Before a run writes anything: the verified checkpoint it continues from (or None), with
    its output directory (``checkpoints.root``'s parent) claimed for it."""
    found = resume_point(checkpoints, how, overwrite=overwrite, console=console)
    claim_run_dir(
        checkpoints.root.parent,
        resuming=found is not None,
        overwrite=overwrite,
        writer=writer,
        console=console,
    )
    return found
