"""Assemble an SFT job from the command line: config, validation, workers, training, report.

Everything that can be checked without training is checked before the first output file is
written: the engine is installed, compatible and declares what the config asks of it (an
engine without ``packed`` or ``dynamic_batch`` gets padded batches or fixed micro-batches:
:mod:`capabilities`), the output directory can be written, the requested GPU exists, the model
and tokenizer load, every data row tokenizes within the truncation policy and the model's
context, the batch size fits the data.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from drivetrain.api import EngineConfig, registry
from drivetrain.api.errors import ConfigError
from drivetrain.trainer.capabilities import fit_single_engine
from drivetrain.trainer.config_loader import load_config, to_yaml
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.data.batching import StepPlan
from drivetrain.trainer.data.tokenize import pad_token_id
from drivetrain.trainer.device_defaults import device_layers, numerics_line
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.hf_export import verify_model_dir
from drivetrain.trainer.job_config import TaskLayers
from drivetrain.trainer.preflight import (
    check_devices,
    check_output_dir,
    load_tokenizer,
    model_context,
)
from drivetrain.trainer.run_loop import run_on_workers
from drivetrain.trainer.sft.config import SFTConfig, sft_config_type
from drivetrain.trainer.sft.dataset import SFTData, load_sft_data
from drivetrain.trainer.sft.trainer import SFTResult, SFTTrainer, total_steps
from drivetrain.trainer.workers.engine_worker import EngineWorker
from drivetrain.trainer.workers.group import WorkerGroup

#: makes a built-in task's layers (``train``: train what it needs first; off for
#: --print-config and --dry-run)
SFTTask = Callable[[bool], TaskLayers]


@dataclass(frozen=True)
class SFTJob:
    engine_name: str
    config: SFTConfig
    task: TaskLayers | None = None  # the built-in task it runs (no data and no model given)
    #: the task as shipped (only where outputs go may differ): its model is what the RL
    #: default run starts from, so only this run caches it
    as_shipped: bool = False

    def to_yaml(self) -> str:
        return to_yaml(self.config)


def load_sft_job(
    engine_name: str,
    *,
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    task: SFTTask | None = None,
    train_prerequisites: bool = True,
) -> SFTJob:
    """Parse the config for ``engine_name``; with no data and no model, ``task``'s."""
    spec = registry.engines.spec(engine_name)  # unknown or unusable: lists what is installed
    config_type = sft_config_type(registry.engines.load_config_class(engine_name, EngineConfig))
    device = device_layers(config_type, files, overrides)  # beneath everything
    config = load_config(config_type, files=[*device, *files], overrides=overrides)
    if config.data.train_path:
        if not config.engine.model.path:
            raise ConfigError("engine.model.path is required when data.train_path is set")
        return SFTJob(
            engine_name,
            fit_single_engine(spec, config, load_config(config_type, files=device)),
        )
    if config.engine.model.path:
        raise ConfigError("data.train_path is required when engine.model.path is set")
    if task is None:
        raise ConfigError("data.train_path and engine.model.path are required")
    layers = task(train_prerequisites)
    config = load_config(
        config_type,
        files=[*device, *layers.files, *files],
        overrides=[*layers.overrides, *overrides],
    )
    default = load_config(config_type, files=[*device, *layers.files], overrides=layers.overrides)
    as_default = dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, output_dir=default.run.output_dir),
        logging=default.logging,
        workers=default.workers,
    )
    return SFTJob(
        engine_name,
        fit_single_engine(spec, config, default),
        layers,
        as_shipped=as_default == default,
    )


@dataclass(frozen=True)
class PreparedSFT:
    job: SFTJob
    data: SFTData
    pad_token_id: int
    steps: int


def prepare(job: SFTJob) -> PreparedSFT:
    """Validate everything a run needs, without writing anything."""

    registry.engines.load(job.engine_name)
    config = job.config
    check_output_dir("run.output_dir", config.run.output_dir)
    check_devices({"engine.device": config.engine.device}, ray_address=config.workers.ray_address)
    model_path = Path(config.engine.model.path)
    verify_model_dir(str(model_path))
    trust = config.engine.model.trust_remote_code
    context = model_context(str(model_path), trust_remote_code=trust)
    path = config.data.tokenizer_path or str(model_path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust)
    data = load_sft_data(config.data, tokenizer, config.seed, context)
    try:
        plan = StepPlan(len(data.train), config.run.batch_size, config.seed, config.data.shuffle)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    return PreparedSFT(job, data, pad_token_id(tokenizer), total_steps(config, plan))


def engine_config_for_run(prepared: PreparedSFT) -> EngineConfig:
    """The engine config with what the job decides: schedule length and seed."""
    engine = prepared.job.config.engine
    optim = dataclasses.replace(engine.optim, total_steps=prepared.steps)
    return dataclasses.replace(engine, optim=optim, seed=prepared.job.config.seed)


def describe(prepared: PreparedSFT) -> str:
    data, config = prepared.data, prepared.job.config
    return (
        f"engine {prepared.job.engine_name}: {len(data.train)} training examples "
        f"({data.train_tokens:,} tokens), {len(data.val)} validation, {data.dropped} dropped "
        f"by truncation; {prepared.steps} steps of {config.run.batch_size} sequences\n"
        f"{numerics_line(config, ['engine'])}"
    )


def run_sft(
    prepared: PreparedSFT, *, resume: str, overwrite: bool = False, console: Console | None = None
) -> SFTResult | None:
    """Train; returns the result on the writing process (rank 0 / the controller)."""
    job, config = prepared.job, prepared.job.config

    def trainer(group: WorkerGroup) -> SFTTrainer:
        return SFTTrainer(
            config,
            engine_name=job.engine_name,
            group=group,
            data=prepared.data,
            pad_token_id=prepared.pad_token_id,
        )

    factory = functools.partial(EngineWorker, job.engine_name, engine_config_for_run(prepared))
    yaml, out = job.to_yaml(), console or plain_console()
    reads = {"engine.model.path": config.engine.model.path}
    return run_on_workers(
        factory, trainer, config, config_yaml=yaml, resume=resume, overwrite=overwrite,
        console=out, reads=reads,
    )  # fmt: skip
