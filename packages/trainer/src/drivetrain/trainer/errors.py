"""Errors the trainer raises on purpose, so the CLI can print them without a traceback."""

from __future__ import annotations

from drivetrain.api.errors import DrivetrainError


class DataError(DrivetrainError, ValueError):
    """A data file is missing, unreadable or malformed, or yields no usable example."""


class CheckpointError(DrivetrainError):
    """A checkpoint to resume from is missing, incomplete, or from another job."""


class WorkerError(DrivetrainError):
    """A worker process failed to start or died; the message carries its error."""


class RunDirectoryError(DrivetrainError):
    """The output directory holds another run that this one would mix with or overwrite."""


class OutputWriteError(DrivetrainError):
    """The output directory stopped taking writes mid-run (read-only, permission, quota, full):
    the message names the path and the checkpoint ``--resume auto`` continues from
    (:mod:`drivetrain.trainer.output_writes`)."""


class NothingToTrain(DrivetrainError):
    """The run to resume is already at or past its last step: nothing was run or written (the
    commands say so in one line and exit 0, so a scheduler's requeue of a finished job is no
    failure)."""


class RunStopped(DrivetrainError):
    """SIGTERM or SIGINT stopped the run (:mod:`drivetrain.trainer.stopping`): the message says
    where and where ``--resume auto`` continues; ``exit_status`` is 128 + the signal."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def said(exc: BaseException, limit: int = 500) -> str:
    """A plugin's exception as ``Type: message`` on one line (its message may span several),
    for the one-line error that wraps it."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:limit]}"
