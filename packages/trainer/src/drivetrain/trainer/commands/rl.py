"""``drivetrain grpo``, ``drivetrain ppo`` and ``drivetrain distill``: RL on any installed
engine, rollout and weight-sync transport."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drivetrain.api import registry
from drivetrain.api.registry import Registry
from drivetrain.trainer.commands.options import (
    ConfigFiles,
    CriticEngine,
    NoPlanCheck,
    Overwrite,
    PluginsDryRun,
    Preset,
    PrintConfig,
    Resume,
    RLEngine,
    RLOverrides,
    RolloutName,
    WeightSync,
)
from drivetrain.trainer.commands.skeleton import JobCommand, run_job_command
from drivetrain.trainer.console import plain_console

if TYPE_CHECKING:
    from drivetrain.trainer.rl.job import PreparedRL, RLJob
    from drivetrain.trainer.rl.trainer import RLResult

console = plain_console()


class RLCommand(JobCommand["RLJob", "PreparedRL", "RLResult"]):
    what = "plugins"

    def __init__(
        self,
        algorithm: str,
        *,
        engine: str,
        critic_engine: str,
        rollout: str,
        weight_sync: str,
        preset: str,
        files: Sequence[Path],
        overrides: Sequence[str],
    ) -> None:
        super().__init__(console, "drivetrain.trainer.rl.job")
        self.algorithm, self.engine, self.critic_engine = algorithm, engine, critic_engine
        self.rollout, self.weight_sync, self.preset = rollout, weight_sync, preset
        self.files, self.overrides = files, overrides

    def load(self, *, train_prerequisites: bool) -> RLJob:
        from drivetrain.trainer.builtin.tasks import rl_task

        task = rl_task(self.algorithm, engine=self.engine, rollout=self.rollout, console=console)
        return self.jobs.load_rl_job(
            self.algorithm,
            engine=self.engine,
            critic_engine=self.critic_engine,
            rollout=self.rollout,
            weight_sync=self.weight_sync,
            files=self.files,
            overrides=self.overrides,
            preset=self.preset,
            task=task,
            train_prerequisites=train_prerequisites,
        )

    def plan_inputs(self, job: RLJob) -> Any:
        from drivetrain.trainer.planning import rl_inputs

        return rl_inputs(job)

    def untrained(self, job: RLJob) -> list[str]:
        from drivetrain.trainer.builtin.prerequisites import untrained

        return untrained(job.task, engine=self.engine, student=self.algorithm == "distill")

    def plugins(self, job: RLJob) -> list[tuple[Registry, str]]:
        rollouts = [] if job.hosted else [(registry.rollouts, job.rollout)]  # not here: there
        return [
            (registry.engines, job.engine),
            (registry.engines, job.critic_engine),
            *rollouts,
            (registry.ckpt_engines, job.transport),
        ]

    def fit(self, prepared: PreparedRL, *, resume: str, overwrite: bool) -> RLResult:
        from drivetrain.trainer.rl.trainer import RLTrainer
        from drivetrain.trainer.run_loop import run_job

        @contextlib.contextmanager
        def launched() -> Iterator[RLTrainer]:
            placement = self.jobs.start(prepared)  # the RL job's worker groups and rollouts
            if placement.where:
                console.print(placement.where)
            try:
                yield RLTrainer(prepared.setup, placement, console)
            finally:
                placement.close()

        result = run_job(
            launched,
            prepared.setup.config.run,
            writer=True,
            config_yaml=prepared.job.to_yaml(),
            resume=resume,
            overwrite=overwrite,
            console=console,
        )
        assert result is not None  # the controller writes
        return result

    def summary(self, job: RLJob, prepared: PreparedRL, result: RLResult) -> dict[str, Any]:
        from drivetrain.trainer.builtin.addition import AdditionAssets

        out = Path(job.config.run.output_dir)
        summary, window = rl_summary(result, out)
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
        gap = summary["log_prob_gap"]
        if gap is not None:
            console.print(
                f"rollout vs trainer log-prob gap per token: {gap['mean']:.3g} mean over "
                f"{gap['steps']} steps, {gap['max']:.3g} at worst (step {gap['max_step']}), "
                f"largest token {gap['token_max']:.3g}; "
                + (f"the alarm is at {gap['alarm']:g}" if gap["alarm"] >= 0 else "the alarm is off")
            )
        addition = job.task is not None and isinstance(job.task.assets, AdditionAssets)
        if addition and summary["greedy_delta"] is not None:
            console.print(
                f"exact-match accuracy on {len(prepared.setup.val)} held-out problems: "
                f"{result.val_before['val/exact_match']:.1%} before, "
                f"{result.val_after['val/exact_match']:.1%} after {self.algorithm.upper()} "
                f"({summary['greedy_delta'] * 100:+.1f} points; {result.seconds / 60:.1f} min)"
            )
        return summary


def rl_summary(result: RLResult, out: Path) -> tuple[dict[str, Any], int]:
    """The run's JSON summary, and how many steps it averages at each end."""
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
        "greedy_delta": greedy_delta(result.val_before, result.val_after),
        "log_prob_gap": log_prob_gap(result),
        "hf_model": str(result.hf_dir) if result.hf_dir else None,
        "reward_curve": str(out / "reward_curve.png"),
        "weight_digests": result.weight_digests,
    }
    return summary, window


def greedy_delta(before: dict[str, float], after: dict[str, float]) -> float | None:
    """What the run changed in its greedy validation score: exact match where the task
    reports it, else the mean reward; None without both validations."""
    for key in ("val/exact_match", "val/mean"):
        if key in before and key in after:
            return after[key] - before[key]
    return None


def log_prob_gap(result: RLResult) -> dict[str, Any] | None:
    """The rollout-vs-trainer log-prob gap over the run's steps (None where no step reported
    one): the mean and worst step of its token mean, the largest single token's, the alarm."""
    gaps = result.log_prob_gaps
    if not gaps:
        return None
    worst = max(gaps, key=lambda step: gaps[step][0])
    return {
        "steps": len(gaps),
        "mean": sum(mean for mean, _ in gaps.values()) / len(gaps),
        "max": gaps[worst][0],
        "max_step": worst,
        "token_max": max(top for _, top in gaps.values()),
        "alarm": result.log_prob_alarm,
    }


def _command(algorithm: str, doc: str) -> Callable[..., None]:
    """The typer command for ``algorithm`` (grpo and ppo take the same options)."""

    def command(
        overrides: RLOverrides = None,
        config: ConfigFiles = None,
        engine: RLEngine = "fsdp2",
        critic_engine: CriticEngine = "",
        rollout: RolloutName = "hf",
        weight_sync: WeightSync = "auto",
        print_config: PrintConfig = False,
        dry_run: PluginsDryRun = False,
        resume: Resume = "auto",
        overwrite: Overwrite = False,
        preset: Preset = "",
        no_plan_check: NoPlanCheck = False,
    ) -> None:
        command = RLCommand(
            algorithm,
            engine=engine,
            critic_engine=critic_engine,
            rollout=rollout,
            weight_sync=weight_sync,
            preset=preset,
            files=config or (),
            overrides=overrides or (),
        )
        run_job_command(
            command,
            print_config=print_config,
            dry_run=dry_run,
            resume=resume,
            overwrite=overwrite,
            plan_check=not no_plan_check,
        )

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
