"""One run loop for every job. SFT, DPO and RL each say what a step is, how they validate and
what their engines save; this module owns the rest, once: the output directory (its lock, the
staging a crash left, where to start), resume, the steps between stop signals with a progress
line, validation and checkpoints at their cadence, the last checkpoint, the Hugging Face
export, the curve and ``config.yaml``; an output directory that stops taking writes ends the
run in one line (:mod:`drivetrain.trainer.output_writes`).

A job is launched inside the claimed directory (SFT and DPO start their worker group there,
RL its placement), so no process reads or writes the directory before this run owns it.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from rich.console import Console

from drivetrain.runtime.heap import settled_heap
from drivetrain.trainer.checkpoints import Checkpoint, CheckpointManager
from drivetrain.trainer.forced_exit import on_forced_exit
from drivetrain.trainer.metrics import LOSS_CURVE, Curve, MetricsLogger
from drivetrain.trainer.output_writes import output_writes
from drivetrain.trainer.progress import TrainingProgress
from drivetrain.trainer.run_dir import adopt_checkpoint, check_steps_left, start_point, steps_knob
from drivetrain.trainer.run_lock import owning
from drivetrain.trainer.stopping import Position, run_signals, stop_here
from drivetrain.trainer.workers.group import (
    SavesState,
    WorkerFactory,
    WorkerGroup,
    launched_by_torchrun,
)
from drivetrain.trainer.workers.launch import make_worker_group, writes_files
from drivetrain.trainer.workers.shared_paths import SharedPaths

R = TypeVar("R")


@dataclass(frozen=True)
class LoopSpec:
    """What differs between the jobs' runs besides their steps: data, no behaviour."""

    name: str  # the progress line's label
    total: int  # steps
    steps_knob: str  # the option that sets ``total`` (named when nothing is left to train)
    run: Any  # the job's ``run`` section (output_dir, cadences, signals, export_hf)
    logging: Any  # the job's ``logging`` section
    state: Mapping[str, Any]  # what every checkpoint of the run records
    identity: Mapping[str, Any]  # the part of ``state`` a resumed checkpoint must match
    headline: str = "train/loss"  # the metric the progress line shows
    metric_word: str = "loss"
    tokens_per_s: str = "train/tokens_per_s"
    curve: Curve = LOSS_CURVE
    validate_before: bool = False
    validation_label: str = ""  # "<label> before: ..." / "after: ..." lines when set
    max_seconds: float = 0.0  # the loop stops after this many seconds (0: no limit)
    agree: bool = False  # every torchrun rank runs the loop: they agree on a stop
    writer: bool = True  # this process writes the run's files


def supervised_spec(
    name: str, total: int, config: Any, group: WorkerGroup, **rest: Any
) -> LoopSpec:
    """SFT's and DPO's spec: ``total`` steps set by ``run.max_steps`` or ``run.epochs``, the
    loop on every torchrun rank (they agree on a stop), files from the group's writer."""
    return LoopSpec(
        name=name,
        total=total,
        steps_knob=steps_knob(config.run),
        run=config.run,
        logging=config.logging,
        agree=launched_by_torchrun(),
        writer=group.is_writer,
        **rest,
    )


@dataclass
class Outcome:
    """What the loop did; each job turns it into its own result."""

    output_dir: Path
    final_step: int
    #: each step's headline metric (``LoopSpec.headline``), by 1-based step
    headlines: dict[int, float] = field(default_factory=dict)
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    hf_dir: Path | None = None
    seconds: float = 0.0  # from resume to the end
    #: the steps' seconds (generation ahead, mid-run validation and checkpoints included;
    #: validation before and after and the last checkpoint not)
    loop_seconds: float = 0.0


class Job(abc.ABC, Generic[R]):
    """A job as the run loop drives it: its engines live in a worker group, whose ranks each
    save, load and export what they train."""

    spec: LoopSpec
    group: WorkerGroup

    @abc.abstractmethod
    def run_step(self, step: int) -> dict[str, float]:
        """Train 0-based ``step``; its metrics (a non-finite loss is an error here)."""

    @abc.abstractmethod
    def validate(self) -> dict[str, float]:
        """Held-out metrics (``val/...``); empty without validation data."""

    def load(self, engine_path: str) -> int:
        """Load the engines' state from a checkpoint; the step it holds."""
        return self.group.run_all(SavesState.load_checkpoint, engine_path)

    def save(self, engine_path: str, step: int) -> None:
        """Write the engines' state for ``step`` under ``engine_path``."""
        self.group.run_all(SavesState.save_checkpoint, engine_path, step)

    def export(self, hf_dir: str) -> None:
        """Write the trained model as a Hugging Face directory."""
        self.group.run_all(SavesState.export_hf, hf_dir)

    @abc.abstractmethod
    def result(self, outcome: Outcome) -> R:
        """The job's result, from the loop's outcome and what ``record`` kept."""

    def record(self, done: int, metrics: Mapping[str, float]) -> None:
        """Keep what the job's result needs of step ``done``."""

    def describe(self, metrics: Mapping[str, float]) -> str:
        """Validation metrics in one line (``spec.validation_label``'s lines)."""
        return ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in metrics.items())

    def begin(self, start: int) -> None:
        """Before the first step (RL starts generating ahead here)."""

    def end(self) -> None:
        """After the last step, before the last checkpoint."""

    def close(self) -> None:
        """After the run, also a failed one."""


class Checkpointer:
    """Owns when the run's checkpoints are written (every ``run.save_every`` steps, at a stop
    that wants one, at the end) and how: the engines' state, then the trainer's, published
    together; the run's :class:`Position` follows."""

    def __init__(self, job: Job[Any], checkpoints: CheckpointManager, position: Position):
        self.job, self.checkpoints, self.position = job, checkpoints, position

    def due(self, done: int) -> bool:
        return _due(self.job.spec.run.save_every, done, self.job.spec.total)

    def save(self, step: int) -> None:
        out, staging = self.checkpoints.root.parent, self.checkpoints.staging(step)
        with output_writes(out, self.position, staging), self.checkpoints.writing(step):
            self.job.save(self.checkpoints.engine_staging_path(step), step)
            self.checkpoints.publish(
                step, {**self.job.spec.state, "step": step, "time": time.time()}
            )
        self.position.saved = step


def _due(every: int, done: int, total: int) -> bool:
    """Every ``every`` steps, but not at the last: the end of the run does it anyway."""
    return bool(every) and done % every == 0 and done < total


def run_job(
    job_at: Callable[[], AbstractContextManager[Job[R]]],
    run: Any,
    *,
    writer: bool,
    config_yaml: str,
    resume: str,
    overwrite: bool = False,
    console: Console,
) -> R | None:
    """Claim ``run.output_dir``, find where to start, launch the job (``job_at``), run it;
    the job's result on the writing process (rank 0 / the controller), else ``None``.

    Where the run starts is settled on every rank before any process group exists: no rank
    can write into the directory until all have joined the group, so every rank judges the
    same directory."""
    out = Path(run.output_dir)
    checkpoints = CheckpointManager(out / "checkpoints", keep_last=run.keep_last, writer=writer)
    with owning(out, writer=writer):  # before anything in out is read or cleaned
        checkpoints.clean_staging()
        found = start_point(
            checkpoints, resume, overwrite=overwrite, writer=writer, console=console
        )
        with job_at() as job:
            outcome = _fit(job, checkpoints, found, console)
        if not job.spec.writer:
            return None
        done = outcome.final_step
        with output_writes(out, Position(checkpoints, done, done)):
            (out / "config.yaml").write_text(config_yaml)
    return job.result(outcome)


def run_on_workers(
    factory: WorkerFactory,
    job: Callable[[WorkerGroup], Job[R]],
    config: Any,
    *,
    config_yaml: str,
    resume: str,
    overwrite: bool,
    console: Console,
    reads: Mapping[str, str],
) -> R | None:
    """SFT's and DPO's run: :func:`run_job` launching their worker group (``factory`` on
    ``config.workers``) and the job over it; the group closes after the run. ``reads``: config
    key -> the model paths the ranks load (on a cluster, every node must see them)."""

    @contextlib.contextmanager
    def launched() -> Iterator[Job[R]]:
        shared = SharedPaths.of(config.run.output_dir, reads)
        group = make_worker_group(factory, config.workers, shared=shared)
        if line := group.where():
            console.print(line)
        try:
            yield job(group)
        finally:
            group.close()

    return run_job(
        launched,
        config.run,
        writer=writes_files(config.workers),
        config_yaml=config_yaml,
        resume=resume,
        overwrite=overwrite,
        console=console,
    )


def _fit(
    job: Job[Any], checkpoints: CheckpointManager, found: Checkpoint | None, console: Console
) -> Outcome:
    spec = job.spec
    began = time.perf_counter()
    start = 0
    if found is not None:
        adopt_checkpoint(found, spec.identity, checkpoints)
        check_steps_left(found, spec.total, spec.steps_knob)
        start = job.load(found.engine_path)
        console.print(f"resumed from {found.path} at step {start}")
    position = Position(checkpoints, start, start if found else None)
    checkpointer = Checkpointer(job, checkpoints, position)
    outcome = Outcome(Path(spec.run.output_dir), final_step=start)
    if spec.validate_before:
        outcome.val_before = _validated(job, "before", console)
    with output_writes(outcome.output_dir, position):
        logger = None
        try:
            if spec.writer:
                logger = MetricsLogger(
                    outcome.output_dir, spec.logging, run_config=spec.state, resume_step=start
                )
            # the stop grace's forced exit closes it too: TensorBoard's buffered events
            with on_forced_exit(logger.close) if logger else contextlib.nullcontext():
                _train(job, start, checkpointer, logger, outcome, console)
        except BaseException:
            _close(job, logger, failed=True)
            raise
        _close(job, logger, failed=False)
        if spec.writer:
            spec.curve.plot(outcome.output_dir)
    outcome.seconds = time.perf_counter() - began
    return outcome


def _train(
    job: Job[Any],
    start: int,
    checkpointer: Checkpointer,
    logger: MetricsLogger | None,
    outcome: Outcome,
    console: Console,
) -> None:
    """The steps from ``start``, the last checkpoint, validation after and the export."""
    # what the run built so far stays out of the collector's full passes in the loop
    with settled_heap():
        loop_began = time.perf_counter()
        job.begin(start)
        _steps(job, start, checkpointer, logger, outcome, console, loop_began)
        outcome.loop_seconds = time.perf_counter() - loop_began
    job.end()
    # the last step, or earlier when run.max_seconds ran out
    final = outcome.final_step = checkpointer.position.done
    checkpointer.save(final)
    outcome.val_after = _validated(job, "after", console, logger, final)
    if job.spec.run.export_hf:
        outcome.hf_dir = outcome.output_dir / "hf"
        job.export(str(outcome.hf_dir))


def _close(job: Job[Any], logger: MetricsLogger | None, *, failed: bool) -> None:
    """After the run, also a failed one: the job, then the metrics. A failed run's own error
    is the one to see: what closing raises then is dropped (the metrics' last writes fail too
    when the directory did)."""
    with contextlib.suppress(Exception):
        job.close()
    if logger is not None:
        with contextlib.suppress(Exception) if failed else contextlib.nullcontext():
            logger.close()


def _validated(
    job: Job[Any],
    when: str,
    console: Console,
    logger: MetricsLogger | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Validate before or after the steps: logged at ``step`` (after) and said in a line."""
    metrics = job.validate()
    if metrics and logger is not None:
        logger.log(step, metrics)
    if metrics and job.spec.validation_label:
        console.print(f"{job.spec.validation_label} {when}: {job.describe(metrics)}")
    return metrics


def _steps(
    job: Job[Any],
    start: int,
    checkpointer: Checkpointer,
    logger: MetricsLogger | None,
    outcome: Outcome,
    console: Console,
    began: float,
) -> None:
    """Steps ``start`` to ``spec.total`` (fewer when ``spec.max_seconds`` runs out since
    ``began``), with mid-run validation and checkpoints."""
    spec, position = job.spec, checkpointer.position
    with (
        TrainingProgress(
            spec.total,
            start,
            enabled=spec.logging.progress and spec.writer,
            console=console,
            description=spec.name,
            metric=spec.metric_word,
        ) as progress,
        run_signals(spec.run, position, agree=spec.agree) as stop,
    ):
        for step in range(start, spec.total):
            if stop.requested():
                raise stop_here(stop, position, checkpointer.save)
            metrics = job.run_step(step)
            done = position.done = step + 1
            if _due(spec.run.eval_every, done, spec.total):
                metrics.update(job.validate())
            if logger is not None:
                logger.log(done, metrics)
            job.record(done, metrics)
            outcome.headlines[done] = metrics[spec.headline]
            progress.update(
                loss=metrics[spec.headline],
                tokens_per_s=metrics[spec.tokens_per_s],
                task=metrics.get("reward/task"),
            )
            if spec.max_seconds and time.perf_counter() - began >= spec.max_seconds:
                if done < spec.total:
                    console.print(f"run.max_seconds={spec.max_seconds:g} spent: {done} steps")
                break
            if checkpointer.due(done):
                checkpointer.save(done)
