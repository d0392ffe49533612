"""One skeleton for every training command (SFT, DPO and the RL family are siblings on it):
load the job, say what its built-in task trains first, prepare (every check that needs no
worker), fit, summarise. Written once here: what ``--print-config`` and ``--dry-run`` stop
at, verifying the checkpoint to resume from, the summary line, and how a command ends in one
line instead of a traceback."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import typer
from rich.console import Console

from drivetrain.api.errors import DrivetrainError
from drivetrain.api.registry import Registry
from drivetrain.trainer.checkpoints import verify_checkpoint
from drivetrain.trainer.console import print_error, print_ok
from drivetrain.trainer.errors import NothingToTrain, RunStopped
from drivetrain.trainer.stopping import exit_status
from drivetrain.trainer.workers.group import launched_by_torchrun

#: a training command's exit statuses (schedulers read them): 0 trained, or nothing left to
#: train; 2 a one-line error; 128 + the signal when SIGTERM (143) or SIGINT (130) stopped it
EXIT_ERROR = 2


def first_rank() -> bool:
    """Whether this process is torchrun's rank 0, or not under torchrun."""
    return not launched_by_torchrun() or os.environ.get("RANK", "0") == "0"


@contextlib.contextmanager
def ending_in_one_line(console: Console) -> Iterator[None]:
    """Around a command's work: what ends it early prints one line and exits with its status."""
    try:
        yield
    except NothingToTrain as exc:  # a finished run requeued: no failure, nothing written
        if first_rank():  # every torchrun rank finds it; one says so
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


class Job(Protocol):
    def to_yaml(self) -> str: ...


J = TypeVar("J", bound=Job)
P = TypeVar("P")
R = TypeVar("R")


class JobCommand(ABC, Generic[J, P, R]):
    """A training command's steps; :func:`run_job_command` runs them in order."""

    #: what a dry run checks besides the config ("engine" or "plugins")
    what = "engine"

    def __init__(self, console: Console, jobs: str) -> None:
        """``jobs``: the job's module (``drivetrain.trainer.sft.job``...), imported here and
        not at module level: it imports torch, which `drivetrain engines` does not need."""
        self.console = console
        # Our progress bar is the one to watch; read by huggingface_hub when transformers
        # loads (here, in torchrun ranks and in Ray actors, which get HF_* variables forwarded)
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        self.jobs: Any = importlib.import_module(jobs)  # prepare, describe, and its own

    @abstractmethod
    def load(self, *, train_prerequisites: bool) -> J:
        """The job from the command line (its built-in task's models trained first unless
        ``train_prerequisites`` is off: --print-config and --dry-run train nothing)."""

    def untrained(self, job: J) -> list[str]:
        """One line per model the job's built-in task would train first."""
        return []

    @abstractmethod
    def plugins(self, job: J) -> Sequence[tuple[Registry, str]]:
        """The plugins the job uses (a dry run without a model imports them)."""

    def shown_config(self) -> str:
        """What --print-config prints."""
        job = self.load(train_prerequisites=False)
        for line in self.untrained(job):
            self.console.print(line)
        return job.to_yaml()

    def prepare(self, job: J) -> P:
        """Model, data and plugins loaded and checked; nothing written, no worker started."""
        return self.jobs.prepare(job)

    def describe(self, prepared: P) -> str:
        return self.jobs.describe(prepared)

    def plan_inputs(self, job: J) -> Any:
        """What the job trains in a step (:class:`~drivetrain.trainer.planning.PlanInputs`),
        for the memory check on a GPU; None: a job the planner does not read."""
        return None

    @abstractmethod
    def fit(self, prepared: P, *, resume: str, overwrite: bool) -> R | None:
        """Train; the result on the writing process (rank 0 / the controller), else None."""

    @abstractmethod
    def summary(self, job: J, prepared: P, result: R) -> dict[str, Any]:
        """The JSON line the command ends with (and the lines it prints before it)."""


def check_plan(command: JobCommand[Any, Any, Any], job: Any) -> None:
    """On a GPU, refuse a job a role of which will not fit this machine's GPUs (one line,
    before any worker starts); on the CPU (no device memory to check) nothing."""
    from drivetrain.trainer.device_defaults import on_gpu

    inputs = command.plan_inputs(job) if on_gpu() else None
    if inputs is not None:
        from drivetrain.trainer.planning import check_fits, local_target

        check_fits(inputs, local_target(inputs.ranks))


def run_job_command(
    command: JobCommand[Any, Any, Any],
    *,
    print_config: bool,
    dry_run: bool,
    resume: str,
    overwrite: bool,
    plan_check: bool = True,
) -> None:
    """Run ``command``'s steps; what stops it early ends in one line. On a GPU a job a role
    of which will not fit is refused before any worker starts (``plan_check``)."""
    console = command.console
    with ending_in_one_line(console):
        if print_config:
            typer.echo(command.shown_config(), nl=False)
            return
        job = command.load(train_prerequisites=not dry_run)
        untrained = command.untrained(job)
        for line in untrained:
            console.print(line)
        if dry_run and untrained:  # no model to check yet: the plugins are imported, no more
            for registry, name in command.plugins(job):
                registry.load(name)
            print_ok(console, f"dry run: config and {command.what} are valid (no model checked)")
            return
        prepared = command.prepare(job)
        if resume not in ("auto", "none"):
            verify_checkpoint(Path(resume))  # before any worker starts
        console.print(command.describe(prepared))
        if plan_check:
            check_plan(command, job)
        if dry_run:
            print_ok(console, f"dry run: config, {command.what}, model and data are valid")
            return
        result = command.fit(prepared, resume=resume, overwrite=overwrite)
    if result is None:  # a non-zero torchrun rank
        return
    typer.echo(json.dumps(command.summary(job, prepared, result)))
