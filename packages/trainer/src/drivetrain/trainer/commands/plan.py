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


def _untrained_as_base(config: Any, task: Any) -> Any:
    """The built-in job's SFT model before it is trained has its base model's architecture."""
    from drivetrain.trainer.builtin.addition import AdditionAssets, ensure_assets

    if (Path(config.model.path) / "config.json").is_file():
        return config
    if not isinstance(getattr(task, "assets", None), AdditionAssets):
        return config  # unplanned: no model config
    base = ensure_assets().model_dir  # small, seconds: the tokenizer and the untrained model
    return dataclasses.replace(config, model=dataclasses.replace(config.model, path=str(base)))


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
    from drivetrain.trainer.plan_target import PlanTarget, accelerator
    from drivetrain.trainer.planning import plan_with_fixes, refusal, rl_inputs, sft_inputs

    target = PlanTarget(accelerator(gpu), gpus=gpus, nodes=nodes)
    files, said = list(config or ()), list(overrides or ())
    if job in RL_JOBS:
        from drivetrain.trainer.builtin.tasks import rl_task
        from drivetrain.trainer.rl.job import load_rl_job

        task = rl_task(job, engine=engine, rollout=rollout, console=plain_console())
        loaded = load_rl_job(
            job, engine=engine, rollout=rollout, files=files, overrides=said, task=task,
            train_prerequisites=False,
        )  # fmt: skip
        inputs = rl_inputs(loaded.config, engine)
        actor = _untrained_as_base(loaded.config.actor, loaded.task)
        inputs = dataclasses.replace(inputs, roles=(("actor", engine, actor),))
    elif job == "sft":
        from drivetrain.trainer.builtin.addition_sft import addition_sft
        from drivetrain.trainer.sft.job import load_sft_job

        inputs = sft_inputs(
            load_sft_job(
                engine, files=files, overrides=said, task=addition_sft, train_prerequisites=False
            ).config,
            engine,
        )
    else:
        raise typer.BadParameter(f"{job!r}: plan takes grpo, ppo, distill or sft")
    results = [
        plan_with_fixes(role, name, cfg, inputs.sequences, inputs.length, target)
        for role, name, cfg in inputs.roles
    ]
    rows = [{**p.row(target), "fits_with": [s for s, _ in fixes]} for p, fixes in results]
    result = {"job": job, "gpus": gpus, "nodes": nodes, "gpu": gpu, "roles": rows}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        for (planned, fixes), r in zip(results, rows, strict=True):
            if not r["planned"]:
                typer.echo(f"{r['role']} ({r['engine']}): unplanned: {r['reason']}")
            elif not r["fits"]:
                typer.echo(refusal(planned, target, fixes))
            else:
                parts = ", ".join(f"{k} {v:.3g}" for k, v in r["gib"].items() if v)
                typer.echo(
                    f"{r['role']} ({r['engine']}, {r['world_size']} ranks, {r['tokens']} tokens "
                    f"in the largest micro-batch): peak {r['peak_gib']:g} GiB of "
                    f"{r['device_gib']:g}: fits. GiB per rank: {parts}"
                )
    if any(r.get("fits") is False for r in rows):
        raise typer.Exit(1)
