"""``drivetrain grpo`` and ``drivetrain ppo``: RL on any installed engine, rollout and
weight-sync transport."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from drivetrain.api import registry
from drivetrain.trainer.command_flow import (
    ending_in_one_line,
    prepared_for_training,
    settled_before_preparing,
)
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.run_options import ConfigFiles, Overwrite, Resume

console = plain_console()


def _run(
    algorithm: str,
    overrides: list[str] | None,
    config: list[Path] | None,
    engine: str,
    critic_engine: str,
    rollout: str,
    weight_sync: str,
    print_config: bool,
    dry_run: bool,
    resume: str,
    overwrite: bool,
    preset: str,
) -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from drivetrain.trainer.builtin.prerequisites import (
        untrained_calculator,
        untrained_prerequisites,
    )
    from drivetrain.trainer.rl.job import describe, load_rl_job, prepare, start
    from drivetrain.trainer.rl.trainer import RLTrainer

    with ending_in_one_line(console):
        job = load_rl_job(
            algorithm,
            engine=engine,
            critic_engine=critic_engine,
            rollout=rollout,
            weight_sync=weight_sync,
            files=config or (),
            overrides=overrides or (),
            console=console,
            preset=preset,
            train_prerequisites=not (print_config or dry_run),
        )
        untrained = []
        if job.builtin is not None:
            student = algorithm == "distill"
            untrained = untrained_prerequisites(job.builtin, engine=engine, student=student)
        if job.builtin_env is not None:
            untrained = untrained_calculator(job.builtin_env, engine=engine)
        plugins = [
            (registry.engines, job.engine), (registry.engines, job.critic_engine),
            (registry.rollouts, job.rollout), (registry.ckpt_engines, job.transport),
        ]  # fmt: skip
        if settled_before_preparing(
            job, untrained, print_config=print_config, dry_run=dry_run,
            plugins=plugins, what="plugins", console=console,
        ):  # fmt: skip
            return
        prepared = prepared_for_training(
            prepare, describe, job, resume=resume, dry_run=dry_run, what="plugins", console=console
        )
        if prepared is None:
            return
        placement = start(prepared)
        try:
            result = RLTrainer(prepared.setup, placement, console).fit(
                resume=resume, overwrite=overwrite
            )
        finally:
            placement.close()
    out = Path(job.config.run.output_dir)
    (out / "config.yaml").write_text(job.to_yaml())
    rewards = [result.rewards[step] for step in sorted(result.rewards)]
    tasks = [result.task_rewards[step] for step in sorted(result.task_rewards)]
    window = min(10, len(rewards) // 2)  # steps averaged at each end (one step is noisy)
    summary = {
        "output_dir": str(result.output_dir),
        "steps": result.final_step,
        "seconds": round(result.seconds, 1),
        "loop_seconds": round(result.loop_seconds, 2),
        "reward_first_step": rewards[0] if rewards else None,
        "reward_last_step": rewards[-1] if rewards else None,
        "reward_first_steps_mean": sum(rewards[:window]) / window if window else None,
        "reward_last_steps_mean": sum(rewards[-window:]) / window if window else None,
        # with DAPO's overlong shaping: the task's own reward (the penalty can dominate the total)
        **(
            {
                "task_reward_first_steps_mean": sum(tasks[:window]) / window,
                "task_reward_last_steps_mean": sum(tasks[-window:]) / window,
            }
            if window and len(tasks) == len(rewards)
            else {}
        ),
        "val_before": result.val_before,
        "val_after": result.val_after,
        "hf_model": str(result.hf_dir) if result.hf_dir else None,
        "reward_curve": str(out / "reward_curve.png"),
        "weight_digests": result.weight_digests,
    }
    weights = job.config.reward.weights
    if window and not (weights and not any(weights)):  # all-zero weights: the reward is 0
        console.print(
            f"train reward (sampled, mean of {window} steps): "
            f"{summary['reward_first_steps_mean']:.3f} first, "
            f"{summary['reward_last_steps_mean']:.3f} last"
        )
    if "task_reward_first_steps_mean" in summary:
        console.print(
            f"task reward without the overlong penalty (mean of {window} steps): "
            f"{summary['task_reward_first_steps_mean']:.3f} first, "
            f"{summary['task_reward_last_steps_mean']:.3f} last"
        )
    if job.builtin is not None and result.val_before and result.val_after:
        console.print(
            f"exact-match accuracy on {len(prepared.setup.val)} held-out problems: "
            f"{result.val_before['val/exact_match']:.1%} before, "
            f"{result.val_after['val/exact_match']:.1%} after {algorithm.upper()} "
            f"({result.seconds / 60:.1f} min)"
        )
    typer.echo(json.dumps(summary))


Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted config overrides, e.g. actor.optim.lr=1e-6 run.steps=100"),
]
Engine = Annotated[
    str, typer.Option("--engine", help="Engine of the actor and reference (`drivetrain engines`).")
]
CriticEngine = Annotated[
    str,
    typer.Option("--critic-engine", help="Critic and reward-model engine (default: --engine)."),
]
RolloutName = Annotated[
    str, typer.Option("--rollout", help="Rollout backend (`drivetrain rollouts`).")
]
WeightSync = Annotated[
    str,
    typer.Option(
        "--weight-sync",
        help="Transport (`drivetrain ckpt-engines`); auto: colocated or broadcast by placement.",
    ),
]
Preset = Annotated[
    str,
    typer.Option(
        "--preset",
        help="A named variant's algorithm settings (grpo, dr_grpo, bnpo, dapo, cispo, "
        "reinforce_pp, reinforce_pp_baseline: trainer README); files and overrides win.",
    ),
]
PrintConfig = Annotated[bool, typer.Option("--print-config", help="Print the config and exit.")]
DryRun = Annotated[
    bool, typer.Option("--dry-run", help="Validate plugins, model and data; exit without training.")
]


def _command(algorithm: str, doc: str) -> Callable[..., None]:
    """The typer command for ``algorithm`` (grpo and ppo take the same options)."""

    def command(
        overrides: Overrides = None,
        config: ConfigFiles = None,
        engine: Engine = "fsdp2",
        critic_engine: CriticEngine = "",
        rollout: RolloutName = "hf",
        weight_sync: WeightSync = "auto",
        print_config: PrintConfig = False,
        dry_run: DryRun = False,
        resume: Resume = "auto",
        overwrite: Overwrite = False,
        preset: Preset = "",
    ) -> None:
        _run(algorithm, overrides, config, engine, critic_engine, rollout, weight_sync,
             print_config, dry_run, resume, overwrite, preset)  # fmt: skip

    command.__name__ = command.__qualname__ = algorithm
    command.__doc__ = doc
    return command


grpo = _command(
    "grpo",
    "GRPO. With no data and no model: the built-in addition task from the built-in SFT model.",
)
ppo = _command(
    "ppo", "PPO with GAE and a critic. With no data and no model: the built-in addition task."
)
distill = _command(
    "distill",
    "On-policy distillation: a teacher (teacher.model_path) scores every token the student "
    "samples. With no data and no model: the built-in SFT model teaches a smaller student.",
)
