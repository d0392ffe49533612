"""The steps every training command takes between loading its job and training, written once:
what a missing prerequisite means for ``--print-config`` and ``--dry-run``, then preparing the
job, checking the checkpoint to resume from, and the dry run's verdict; and how a command
ends in one line instead of a traceback."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import typer
from rich.console import Console

from drivetrain.api.errors import DrivetrainError
from drivetrain.api.registry import Registry
from drivetrain.trainer.checkpoints import verify_checkpoint
from drivetrain.trainer.console import print_error, print_ok
from drivetrain.trainer.errors import NothingToTrain, RunStopped
from drivetrain.trainer.stopping import exit_status

#: a training command's exit statuses (schedulers read them): 0 trained, or nothing left to
#: train; 2 a one-line error; 128 + the signal when SIGTERM (143) or SIGINT (130) stopped it
EXIT_ERROR = 2


@contextlib.contextmanager
def ending_in_one_line(console: Console) -> Iterator[None]:
    """Around a command's work: what ends it early prints one line and exits with its status."""
    try:
        yield
    except NothingToTrain as exc:  # a finished run requeued: no failure, nothing written
        console.print(str(exc))
        raise typer.Exit(0) from None
    except RunStopped as exc:
        console.print(str(exc))
        raise typer.Exit(exc.exit_status) from None
    except DrivetrainError as exc:
        print_error(console, exc)
        raise typer.Exit(EXIT_ERROR) from None
    except KeyboardInterrupt:  # outside the training loop, where SIGINT stops at a step's end
        console.print(
            "interrupted by SIGINT outside a training step: no new checkpoint; --resume auto "
            "continues from the newest one"
        )
        raise typer.Exit(exit_status(signal.SIGINT)) from None


J = TypeVar("J")
P = TypeVar("P")


def settled_before_preparing(
    job: Any,
    untrained: Sequence[str],
    *,
    print_config: bool,
    dry_run: bool,
    plugins: Sequence[tuple[Registry, str]],
    what: str,
    console: Console,
) -> bool:
    """Say which built-in prerequisites are still untrained; print the config for
    ``--print-config``; a dry run with one missing has no model to check, so it imports the
    chosen ``plugins`` and stops. Returns whether the command is done."""
    for line in untrained:
        console.print(line)
    if print_config:
        typer.echo(job.to_yaml(), nl=False)
        return True
    if dry_run and untrained:
        for registry, name in plugins:
            registry.load(name)
        print_ok(console, f"dry run: config and {what} are valid (no model checked)")
        return True
    return False


def prepared_for_training(
    prepare: Callable[[J], P],
    describe: Callable[[P], str],
    job: J,
    *,
    resume: str,
    dry_run: bool,
    what: str,
    console: Console,
) -> P | None:
    """The prepared job (model and data loaded and checked), the resume path verified before
    any worker starts; ``None`` after a dry run's verdict."""
    prepared = prepare(job)
    if resume not in ("auto", "none"):
        verify_checkpoint(Path(resume))
    console.print(describe(prepared))
    if dry_run:
        print_ok(console, f"dry run: config, {what}, model and data are valid")
        return None
    return prepared
