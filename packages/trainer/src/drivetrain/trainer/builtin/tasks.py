"""The built-in tasks the RL and preference commands run when given no data and no model: the
hooks their jobs take (:class:`~drivetrain.trainer.job_config.TaskLayers`), built on top of
the jobs (they train the SFT model they start from with the SFT job), never beneath them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.builtin import addition, calculator_assets
from drivetrain.trainer.builtin.addition_sft import ensure_sft_model
from drivetrain.trainer.builtin.student import ensure_student_model
from drivetrain.trainer.job_config import TaskLayers

if TYPE_CHECKING:
    from drivetrain.trainer.dpo.job import DPOJob, DPOTask
    from drivetrain.trainer.dpo.trainer import DPOResult
    from drivetrain.trainer.rl.config import RLConfig
    from drivetrain.trainer.rl.job import RLTask

HERE = Path(__file__).parent
DPO_CONFIG = HERE / "addition_dpo.yaml"
GRPO_CONFIG = HERE / "addition_grpo.yaml"
DISTILL_CONFIG = HERE / "addition_distill.yaml"  # over the distill command's own defaults
#: the built-in agentic task: env=calculator with no model
CALCULATOR = "calculator"
CALCULATOR_CONFIG = HERE / "calculator_grpo.yaml"
#: answers sampled per held-out problem for the DPO report's sampled accuracy
SAMPLES = 4


def addition_dpo(engine: str, console: Console | None) -> DPOTask:
    """Pairs whose chosen answer is the true sum and whose rejected one is the careless
    annotator's slip, from the built-in SFT model (trained first on ``engine`` if missing)."""

    def layers(train: bool) -> TaskLayers:
        assets = addition.ensure_assets()
        pairs, held_out = addition.ensure_preference_pairs(assets)
        model = ensure_sft_model(assets, console, engine=engine, train=train)
        return TaskLayers(
            files=(DPO_CONFIG,),
            overrides=(
                f"engine.model.path={model}",
                f"data.train_path={pairs}",
                f"data.val_path={held_out}",
            ),
            assets=assets,
        )

    return layers


def rl_task(algorithm: str, *, engine: str, rollout: str, console: Console | None) -> RLTask:
    """The addition task from the built-in SFT model (distill: that model teaches a smaller
    student), or with ``env=calculator`` the agentic task from its tool-using SFT model, or
    with another ``env=`` that environment's own tasks from a tiny model warmed up on its
    demonstrations (:mod:`~drivetrain.trainer.builtin.demonstrated`).
    Nothing is built for a config that is only shown: it names where the files will be."""

    def layers(config: RLConfig, train: bool) -> TaskLayers:
        if config.episodic:
            if not config.env:  # an agent plays data rows: nothing to demonstrate
                raise ConfigError(
                    "actor.model.path is required with agent.command and no env (a built-in "
                    f"model comes with env={CALCULATOR}, or an env that demonstrates its task)"
                )
            if config.env != CALCULATOR:
                # the environment's demonstrations warm a tiny model up (refused in one line
                # when it has none); imported here: it loads the environment, with torch
                from drivetrain.trainer.builtin import demonstrated

                env, model = demonstrated.ensure_warm_start(
                    config, console, engine=engine, train=train
                )
                return TaskLayers(
                    files=for_rollout(rollout, demonstrated.GRPO_CONFIG),
                    overrides=(f"actor.model.path={model}",),
                    assets=env,
                )
            env = calculator_assets.ensure_assets() if train else calculator_assets.assets_at()
            model = calculator_assets.ensure_sft_model(env, console, engine=engine, train=train)
            return TaskLayers(
                files=for_rollout(rollout, CALCULATOR_CONFIG),
                overrides=(f"actor.model.path={model}",),
                assets=env,
            )
        assets = addition.ensure_assets() if train else addition.assets_at()
        model = ensure_sft_model(assets, console, engine=engine, train=train)
        data = (f"data.train_path={assets.rl_path}", f"data.val_path={assets.test_path}")
        if algorithm != "distill":
            return TaskLayers(
                files=for_rollout(rollout, GRPO_CONFIG),
                overrides=(f"actor.model.path={model}", *data),
                assets=assets,
            )
        student = ensure_student_model(assets, console, engine=engine, train=train)
        return TaskLayers(
            files=for_rollout(rollout, GRPO_CONFIG),
            algorithm_files=(DISTILL_CONFIG,),
            overrides=(f"actor.model.path={student}", f"teacher.model_path={model}", *data),
            assets=assets,
        )

    return layers


def for_rollout(rollout: str, base: Path) -> tuple[Path, ...]:
    """A built-in job's YAML, then its settings for this rollout backend when it has some
    (``addition_grpo.hf.yaml``: keys only that backend's config has)."""
    own = base.with_suffix(f".{rollout}.yaml")
    return (base, *((own,) if own.exists() else ()))


def dpo_report(job: DPOJob, result: DPOResult) -> dict[str, Any]:
    """Exact-match accuracy on the held-out problems, greedy and sampled (temperature 1,
    ``SAMPLES`` each), the starting model against the trained one."""
    from drivetrain.trainer.builtin.exact_match import exact_match

    assert job.task is not None and result.hf_dir is not None
    assets: addition.AdditionAssets = job.task.assets
    rows = [json.loads(line) for line in assets.test_path.read_text().splitlines()]
    report: dict[str, Any] = {"test_examples": len(rows)}
    for when, model in (("before", job.config.engine.model.path), ("after", str(result.hf_dir))):
        report[f"exact_match_{when}"] = exact_match(model, rows)
        report[f"sampled_accuracy_{when}"] = exact_match(model, rows, samples=SAMPLES)
    return report
