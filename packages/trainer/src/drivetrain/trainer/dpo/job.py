"""Assemble a preference job (``drivetrain dpo``): config, checks that need no worker, the
worker group (actor, and a frozen reference engine when the reference is one), the run.

With no data and no model: the built-in addition task, starting from the built-in SFT model
(the SFT default runs first when it is not cached), on pairs whose chosen answer is the true
sum and whose rejected one is the careless annotator's slip.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api import EngineConfig, registry
from drivetrain.api.errors import ConfigError
from drivetrain.api.plugin import PluginSpec
from drivetrain.trainer.builtin import addition
from drivetrain.trainer.builtin.addition_sft import ensure_sft_model
from drivetrain.trainer.capabilities import fit_single_engine, require_adapter_reference
from drivetrain.trainer.config_loader import load_config, to_yaml
from drivetrain.trainer.data.batching import StepPlan
from drivetrain.trainer.data.tokenize import pad_token_id
from drivetrain.trainer.dpo.config import DPOConfig, dpo_config_type
from drivetrain.trainer.dpo.data import load_pairs
from drivetrain.trainer.dpo.trainer import DPOResult, DPOTrainer, PreferenceData, total_steps
from drivetrain.trainer.dpo.worker import PreferenceWorker
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.hf_export import verify_model_dir
from drivetrain.trainer.preflight import (
    check_devices,
    check_output_dir,
    load_tokenizer,
    model_context,
)
from drivetrain.trainer.supervised_run import run_supervised
from drivetrain.trainer.workers.group import WorkerGroup
from drivetrain.trainer.workers.role_worker import ACTOR, REFERENCE, RoleSpec

BUILTIN_CONFIG = Path(__file__).parent.parent / "builtin" / "addition_dpo.yaml"


@dataclass(frozen=True)
class DPOJob:
    engine_name: str
    config: DPOConfig
    builtin: addition.AdditionAssets | None = None

    def to_yaml(self) -> str:
        return to_yaml(self.config)


def load_dpo_job(
    engine_name: str,
    *,
    files: Sequence[str | Path] = (),
    overrides: Sequence[str] = (),
    console: Console | None = None,
    train_prerequisites: bool = True,
) -> DPOJob:
    """Parse the config; with no data and no model, the built-in task (its SFT model trained
    first when missing, unless ``train_prerequisites`` is off: then the config names where
    that model will be)."""
    spec = registry.engines.spec(engine_name)  # unknown or unusable: lists what is installed
    config_type = dpo_config_type(registry.engines.load_config_class(engine_name, EngineConfig))
    config = load_config(config_type, files=files, overrides=overrides)
    if config.data.train_path:
        if not config.engine.model.path:
            raise ConfigError("engine.model.path is required when data.train_path is set")
        return DPOJob(engine_name, fit_engine(spec, config, load_config(config_type)))
    if config.engine.model.path:
        raise ConfigError("data.train_path is required when engine.model.path is set")
    assets = addition.ensure_assets()
    train, test = addition.ensure_preference_pairs(assets)
    model = ensure_sft_model(assets, console, engine=engine_name, train=train_prerequisites)
    builtin = [f"engine.model.path={model}", f"data.train_path={train}", f"data.val_path={test}"]
    config = load_config(
        config_type, files=[BUILTIN_CONFIG, *files], overrides=[*builtin, *overrides]
    )
    default = load_config(config_type, files=[BUILTIN_CONFIG], overrides=builtin)
    return DPOJob(engine_name, fit_engine(spec, config, default), assets)


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
        f"{len(prepared.data.val)} held-out; {prepared.steps} steps of {c.run.batch_size} pairs"
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

    def trainer(group: WorkerGroup, console: Console) -> DPOTrainer:
        return DPOTrainer(
            c, engine_name=job.engine_name, group=group, data=prepared.data, console=console
        )

    return run_supervised(
        c.run, c.workers, factory=functools.partial(PreferenceWorker, role_specs(prepared)),
        trainer=trainer, config_yaml=job.to_yaml(), resume=resume, overwrite=overwrite,
        console=console,
    )  # fmt: skip


#: answers sampled per held-out problem for the sampled accuracy
SAMPLES = 4


def builtin_report(job: DPOJob, result: DPOResult) -> dict[str, Any]:
    """Exact-match accuracy on the held-out problems, greedy and sampled (temperature 1,
    ``SAMPLES`` each), the starting model against the trained one."""
    import json

    from drivetrain.trainer.builtin.exact_match import exact_match

    assert job.builtin is not None and result.hf_dir is not None
    rows = [json.loads(line) for line in job.builtin.test_path.read_text().splitlines()]
    report: dict[str, Any] = {"test_examples": len(rows)}
    for when, model in (("before", job.config.engine.model.path), ("after", str(result.hf_dir))):
        report[f"exact_match_{when}"] = exact_match(model, rows)
        report[f"sampled_accuracy_{when}"] = exact_match(model, rows, samples=SAMPLES)
    return report
