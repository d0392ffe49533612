"""``drivetrain plan JOB``: the memory each training role of a job will take on each rank of a
target cluster, from the engines' own code on fake tensors, before anything starts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any

import typer

from drivetrain.trainer.commands.options import ConfigFiles, RLOverrides
from drivetrain.trainer.console import plain_console

RL_JOBS = ("grpo", "ppo", "distill")


def _untrained_as_base(inputs: Any, task: Any) -> Any:
    """The built-in job's SFT model before it is trained has its base model's architecture:
    roles on a model not made yet are planned on the base model."""
    from drivetrain.trainer.builtin.addition import AdditionAssets, ensure_assets

    if not isinstance(getattr(task, "assets", None), AdditionAssets):
        return inputs  # unplanned where there is no model config

    def based(config: Any) -> Any:
        if (Path(config.model.path) / "config.json").is_file():
            return config
        base = ensure_assets().model_dir  # small, seconds: the tokenizer and untrained model
        return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(base)))

    roles = tuple(dataclasses.replace(r, config=based(r.config)) for r in inputs.roles)
    return dataclasses.replace(inputs, roles=roles)


def job_inputs(
    job: str, engine: str, rollout: str, files: list[str], said: list[str]
) -> tuple[Any, int]:
    """What ``job`` (grpo, ppo, distill or sft) configured by ``files`` and ``said`` runs in a
    step (:class:`~drivetrain.trainer.planning.PlanInputs`), and the GPUs of its rollouts
    when they have their own (separate placement)."""
    from drivetrain.trainer.plan_rank import rollout_share
    from drivetrain.trainer.planning import rl_inputs, sft_inputs

    if job in RL_JOBS:
        from drivetrain.trainer.builtin.tasks import rl_task
        from drivetrain.trainer.rl.job import load_rl_job

        task = rl_task(job, engine=engine, rollout=rollout, console=plain_console())
        loaded = load_rl_job(
            job, engine=engine, rollout=rollout, files=files, overrides=said, task=task,
            train_prerequisites=False,
        )  # fmt: skip
        inputs = _untrained_as_base(rl_inputs(loaded), loaded.task)
        if inputs.colocated and inputs.rollout is None:  # sized from the model planned
            share = rollout_share(loaded.rollout, loaded.config.rollout, inputs.roles[0].config)
            inputs = dataclasses.replace(inputs, rollout=share)
        return inputs, loaded.config.placement.rollout_replicas
    if job == "sft":
        from drivetrain.trainer.builtin.addition_sft import addition_sft
        from drivetrain.trainer.sft.job import load_sft_job

        loaded_sft = load_sft_job(
            engine, files=files, overrides=said, task=addition_sft, train_prerequisites=False
        )
        return sft_inputs(loaded_sft.config, engine), 0
    raise typer.BadParameter(f"{job!r}: plan takes grpo, ppo, distill or sft")


def checkpointing_flipped(inputs: Any, target: Any) -> dict[str, Any] | None:
    """The first training role's own peak with activation checkpointing the other way round
    (what checkpointing saves, or costs, on this job); None when it cannot be planned."""
    from drivetrain.trainer.planning import plan_role, rank_work

    role = next((r for r in inputs.roles if r.train), None)
    if role is None:
        return None
    model = role.config.model
    flipped = dataclasses.replace(model, gradient_checkpointing=not model.gradient_checkpointing)
    config = dataclasses.replace(role.config, model=flipped)
    work = rank_work(config, inputs.sequences, inputs.length, target.gpus)
    other = plan_role(role.role, role.engine, config, work, target)
    if other.plan is None:
        return None
    return {
        "role": role.role,
        "gradient_checkpointing": flipped.gradient_checkpointing,
        "peak_gib": round(other.plan.peak_gib, 2),
        "activations_gib": round(other.plan.by_category.get("activations", 0) / 2**30, 3),
    }


def plan(
    job: Annotated[str, typer.Argument(help="grpo, ppo, distill or sft.")] = "grpo",
    overrides: RLOverrides = None,
    config: ConfigFiles = None,
    engine: Annotated[str, typer.Option("--engine", help="Training engine.")] = "fsdp2",
    rollout: Annotated[str, typer.Option("--rollout", help="Rollout backend (RL).")] = "hf",
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in all.")] = 8,
    gpu: Annotated[str, typer.Option("--gpu", help="h100-80gb, h200-141gb, a100-80gb...")] = (
        "h100-80gb"
    ),
    nodes: Annotated[int, typer.Option("--nodes", help="Nodes the GPUs are spread over.")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, nothing else.")] = False,
) -> None:
    """Plan a job for a cluster: per-rank memory of each training role, and whether it fits."""
    from drivetrain.trainer.plan_report import lines, report, time_of
    from drivetrain.trainer.plan_target import PlanTarget, accelerator
    from drivetrain.trainer.planning import plan_with_fixes

    target = PlanTarget(accelerator(gpu), gpus=gpus, nodes=nodes)
    inputs, rollout_gpus = job_inputs(
        job, engine, rollout, list(config or ()), list(overrides or ())
    )
    planned, fixes = plan_with_fixes(inputs, target)
    result = report(job, planned, fixes, time_of(inputs, target, rollout_gpus=rollout_gpus))
    result["checkpointing_flipped"] = checkpointing_flipped(inputs, target)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for line in lines(result, planned, fixes):
            typer.echo(line)
    if result["fits"] is False:
        raise typer.Exit(1)
