"""The run of a supervised job (SFT, DPO) around its trainer: own the output directory, find
where to start, launch the worker group, fit, keep the config. The jobs differ only in the
workers they launch and the trainer they build."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

from rich.console import Console

from drivetrain.trainer.checkpoints import Checkpoint, CheckpointManager
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.job_config import RunConfig, WorkersConfig
from drivetrain.trainer.run_dir import start_point
from drivetrain.trainer.run_lock import owning
from drivetrain.trainer.workers.group import WorkerFactory, WorkerGroup
from drivetrain.trainer.workers.launch import make_worker_group, writes_files

R = TypeVar("R", covariant=True)


class Fits(Protocol[R]):
    """A job's trainer: fits from a checkpoint (or the start), returning the job's result."""

    def fit(self, *, start_from: Checkpoint | None = None) -> R: ...


def run_supervised(
    run: RunConfig,
    workers: WorkersConfig,
    *,
    factory: WorkerFactory,
    trainer: Callable[[WorkerGroup, Console], Fits[R]],
    config_yaml: str,
    resume: str,
    overwrite: bool = False,
    console: Console | None = None,
) -> R | None:
    """Train; the result on the writing process (rank 0 / the controller), else ``None``.

    Where the run starts (which checkpoint, whose directory) is settled on every rank before
    any process group exists: no rank can write into the directory until all have joined the
    group, so every rank judges the same directory."""
    console = console or plain_console()
    out = Path(run.output_dir)
    writer = writes_files(workers)
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=run.keep_last, writer=writer)
    with owning(out, writer=writer):  # before anything in out is read or cleaned
        checkpoints.clean_staging()
        start_from = start_point(
            checkpoints, resume, overwrite=overwrite, writer=writer, console=console
        )
        group = make_worker_group(factory, workers)
        try:
            result = trainer(group, console).fit(start_from=start_from)
        finally:
            group.close()
        if not group.is_writer:
            return None
        (out / "config.yaml").write_text(config_yaml)
    return result
