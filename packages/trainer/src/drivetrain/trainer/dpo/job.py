"""Assemble a preference job (``drivetrain dpo``): config, checks that need no worker, the
worker group (actor, and a frozen reference engine when the reference is one), the run.

With no data and no model: the command's built-in task (a hook: ``drivetrain dpo`` passes the
addition pairs of :mod:`drivetrain.trainer.builtin.tasks`).
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
from drivetrain.api.plugin import PluginSpec
from drivetrain.trainer.capabilities import fit_single_engine, require_adapter_reference
from drivetrain.trainer.config_loader import load_config, to_yaml
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.data.batching import StepPlan
from drivetrain.trainer.data.tokenize import pad_token_id
from drivetrain.trainer.device_defaults import device_layers, numerics_line
from drivetrain.trainer.dpo.config import DPOConfig, dpo_config_type
from drivetrain.trainer.dpo.data import load_pairs
from drivetrain.trainer.dpo.trainer import DPOResult, DPOTrainer, PreferenceData, total_steps
from drivetrain.trainer.dpo.worker import PreferenceWorker
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
from drivetrain.trainer.workers.group import WorkerGroup
from drivetrain.trainer.workers.role_worker import ACTOR, REFERENCE, RoleSpec

#: makes a built-in task's layers (``train``: train what it needs first)
DPOTask = Callable[[bool], TaskLayers]


@dataclass(frozen=True)
class DPOJob:
    engine_name: str
    config: DPOConfig
    task: TaskLayers | None = None  # the built-in task it runs (no data and no model given)

    def to_yaml(self) -> str:
        return to_yaml(self.config)


def load_dpo_job(
    engine_name: str,
    *,
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    task: DPOTask | None = None,
    train_prerequisites: bool = True,
) -> DPOJob:
    """Parse the config; with no data and no model, ``task``'s (what it needs trained first
    unless ``train_prerequisites`` is off: then the config names where that will be)."""
    spec = registry.engines.spec(engine_name)  # unknown or unusable: lists what is installed
    config_type = dpo_config_type(registry.engines.load_config_class(engine_name, EngineConfig))
    device = device_layers(config_type, files, overrides)  # beneath everything
    config = load_config(config_type, files=[*device, *files], overrides=overrides)
    if config.data.train_path:
        if not config.engine.model.path:
            raise ConfigError("engine.model.path is required when data.train_path is set")
        return DPOJob(
            engine_name,
            fit_engine(spec, config, load_config(config_type, files=device)),
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
    return DPOJob(engine_name, fit_engine(spec, config, default), layers)


def fit_engine(spec: PluginSpec, config: DPOConfig, job_default: DPOConfig) -> DPOConfig:
    """:func:`fit_single_engine`, and the adapter-disabled reference needs ``lora``."""
    if config.reference_mode == "adapter":
        require_adapter_reference(spec, config.reference.mode)
    return fit_single_engine(spec, config, job_default)


@dataclass(frozen=True)
class PreparedDPO:
    job: DPOJob
    data: PreferenceData
    steps: int


def prepare(job: DPOJob) -> PreparedDPO:
    """Validate everything a run needs, without starting a worker or writing a file."""
    registry.engines.load(job.engine_name)
    c = job.config
    check_output_dir("run.output_dir", c.run.output_dir)
    check_devices({"engine.device": c.engine.device}, ray_address=c.workers.ray_address)
    for path in dict.fromkeys(p for p in (c.engine.model.path, c.reference.model_path) if p):
        verify_model_dir(path)
    trust = c.engine.model.trust_remote_code
    context = model_context(c.engine.model.path, trust_remote_code=trust)
    tokenizer = load_tokenizer(
        c.data.tokenizer_path or c.engine.model.path, trust_remote_code=trust
    )
    precomputed = c.reference_mode == "precomputed"
    load = functools.partial(
        load_pairs, tokenizer=tokenizer, config=c.data, context=context, precomputed=precomputed
    )
    train = load(c.data.train_path)
    val = load(c.data.val_path) if c.data.val_path else []
    try:
        plan = StepPlan(len(train), c.run.batch_size, c.seed, c.data.shuffle)
    except ValueError as exc:
        raise DataError(str(exc).replace("training examples", "training pairs")) from None
    data = PreferenceData(tuple(train), tuple(val), pad_token_id(tokenizer))
    return PreparedDPO(job, data, total_steps(c, plan))


def describe(prepared: PreparedDPO) -> str:
    c = prepared.job.config
    return (
        f"dpo ({c.algorithm.loss}, beta {c.algorithm.beta}, reference {c.reference_mode}) on "
        f"engine {prepared.job.engine_name}: {len(prepared.data.train)} training pairs, "
        f"{len(prepared.data.val)} held-out; {prepared.steps} steps of {c.run.batch_size} pairs\n"
        f"{numerics_line(c, ['engine'])}"
    )


def role_specs(prepared: PreparedDPO) -> dict[str, RoleSpec]:
    c = prepared.job.config
    optim = dataclasses.replace(c.engine.optim, total_steps=prepared.steps)
    actor = dataclasses.replace(c.engine, optim=optim, seed=c.seed)
    roles = {ACTOR: RoleSpec(prepared.job.engine_name, actor)}
    if c.reference_mode == "engine":
        model = dataclasses.replace(actor.model, path=c.reference.model_path or actor.model.path)
        roles[REFERENCE] = RoleSpec(
            prepared.job.engine_name, dataclasses.replace(actor, model=model)
        )
    return roles


def run_dpo(
    prepared: PreparedDPO, *, resume: str, overwrite: bool = False, console: Console | None = None
) -> DPOResult | None:
    """Train; the result on the writing process (rank 0 / the controller), else ``None``."""
    job, c = prepared.job, prepared.job.config

    def trainer(group: WorkerGroup) -> DPOTrainer:
        return DPOTrainer(c, engine_name=job.engine_name, group=group, data=prepared.data)

    factory = functools.partial(PreferenceWorker, role_specs(prepared))
    yaml, out = job.to_yaml(), console or plain_console()
    reads = {
        "engine.model.path": c.engine.model.path,
        "reference.model_path": c.reference.model_path,
    }
    return run_on_workers(
        factory, trainer, c, config_yaml=yaml, resume=resume, overwrite=overwrite, console=out,
        reads=reads,
    )  # fmt: skip
