"""The RL loop: a source draws each step's scored samples, stages add what the updates
need (old and reference log-probs, values, advantages), the updates run, and the source moves
the weights; driven from one controller over any placement."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api import SamplingParams
from drivetrain.api.columns import LOSS_MASK
from drivetrain.runtime.heap import settled_heap
from drivetrain.trainer.checkpoints import CheckpointManager
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.diagnose import log_prob_tolerance
from drivetrain.trainer.metrics import METRICS_FILE, MetricsLogger, plot_curve
from drivetrain.trainer.progress import TrainingProgress
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.episode_setup import EpisodeSetup
from drivetrain.trainer.rl.log_prob_alarm import LogProbAlarm
from drivetrain.trainer.rl.placement import Placement
from drivetrain.trainer.rl.prompts import PromptSampler
from drivetrain.trainer.rl.scoring import SampleScorer
from drivetrain.trainer.rl.source import Drawn, PhaseTimer, SourceContext
from drivetrain.trainer.rl.sources import choose_source
from drivetrain.trainer.rl.stages import StepBatch, build_stages
from drivetrain.trainer.rl.step_metrics import clip_ratio, fmt
from drivetrain.trainer.rl.updates import build_updates, on_policy
from drivetrain.trainer.run_dir import adopt_checkpoint, check_steps_left, start_point
from drivetrain.trainer.run_lock import owning
from drivetrain.trainer.stopping import Position, run_signals, stop_here
from drivetrain.trainer.sync_manager import SyncReport
from drivetrain.trainer.workers.engine_worker import StepStats
from drivetrain.trainer.workers.role_worker import ACTOR, CRITIC, RoleWorker


@dataclass(frozen=True)
class RLSetup:
    """What the loop needs besides the placement: decided by the job before any worker starts."""

    config: RLConfig
    state: dict[str, Any]  # identifies the run in checkpoints (engines, model, algorithm)
    train: Sequence[Any]  # RLPrompts; an environment's tasks with ``episodes``
    val: Sequence[Any]
    pad_token_id: int
    tokenizer: Any
    reference: Reference
    critic: bool
    reward_model: bool
    teacher: bool = False  # on-policy distillation
    episodes: EpisodeSetup | None = None  # env=<name>: multi-turn episodes


@dataclass
class RLResult:
    output_dir: Path
    final_step: int
    rewards: dict[int, float] = field(default_factory=dict)  # 1-based step -> mean reward
    #: with reward shaping (DAPO's overlong penalty): the task's own reward, without it
    task_rewards: dict[int, float] = field(default_factory=dict)
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    hf_dir: Path | None = None
    seconds: float = 0.0
    #: the training loop's seconds (generation ahead, mid-run validation and checkpoints
    #: included; validation before and after and the final checkpoint not): what the modes
    #: change
    loop_seconds: float = 0.0
    weight_digests: dict[int, str] = field(default_factory=dict)  # with weight_sync.verify


class RLTrainer:
    def __init__(self, setup: RLSetup, placement: Placement, console: Console | None = None):
        self.setup, self.placement = setup, placement
        self.config = c = setup.config
        self.group, self.pool, self.weights = placement.group, placement.pool, placement.weights
        self.console = console or plain_console()
        self.out = Path(c.run.output_dir)
        context = SourceContext(
            c, setup.train, setup.val, setup.tokenizer, setup.pad_token_id, self.pool,
            self.weights, PromptSampler(len(setup.train), c.run.prompts_per_step, c.seed),
            SampleScorer(c, setup.tokenizer),
        )  # fmt: skip
        self.source = choose_source(context, setup.episodes, self.out)
        reference = setup.reference
        self.on_policy = on_policy(c, reference.enabled, setup.teacher)
        self.stages = build_stages(
            c, self.group, on_policy=self.on_policy, reference=reference,
            teacher=setup.teacher, reward_model=setup.reward_model, critic=setup.critic,
        )  # fmt: skip
        self.updates = build_updates(c, on_policy=self.on_policy, critic=setup.critic)
        self.trainable = (ACTOR, CRITIC) if setup.critic else (ACTOR,)
        self.checkpoints = CheckpointManager(
            self.out / "checkpoints", keep_last=c.run.keep_last, writer=True
        )
        self.position = Position(self.checkpoints)  # where the run is (for a stop)
        threshold = c.run.log_prob_alarm or log_prob_tolerance(c.actor.model.dtype, c.rollout.dtype)
        self.alarm = LogProbAlarm(threshold, self.console.print)

    # ---- the algorithm ------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step ``step`` (0-based): the source's samples through the stages, the updates,
        the weights moved; its metrics."""
        timer = PhaseTimer()
        drawn = self.source.draw(step, timer)
        batch = StepBatch(
            drawn.batch, drawn.scores, drawn.completions, drawn.played, drawn.reward_metrics
        )
        trained: dict[str, StepStats] = {}
        with self.source.training(step):
            for stage in self.stages:
                with timer(stage.phase):
                    stage.run(batch)
            for update in self.updates:
                with timer(update.phase):
                    trained[update.role] = update.run(self.group, batch.batch, self.config, step)
        report = self.source.weights_after(step)
        if report is not None:
            timer.seconds["weight_sync"] = report.seconds
        return self.step_metrics(drawn, batch, trained, timer.seconds, report)

    def step_metrics(
        self,
        drawn: Drawn,
        batch: StepBatch,
        trained: Mapping[str, StepStats],
        seconds: dict[str, float],
        report: SyncReport | None,
    ) -> dict[str, float]:
        """A step's metrics: rewards, the stages' and updates' own, lengths, times."""
        lengths = drawn.batch[LOSS_MASK].sum(-1).float()  # as sampled (before any filter)
        max_new = self.config.sampling.max_new_tokens
        metrics = {**batch.reward_metrics, **batch.metrics}
        for update in reversed(self.updates):  # the actor's first
            metrics.update(update.metrics(trained[update.role]))
        metrics.update({
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": clip_ratio(drawn.completions, lengths, max_new),
            "perf/tokens_per_s": float(batch.batch.num_tokens) / sum(seconds.values()),
            **{f"time/{k}_s": v for k, v in seconds.items()},
            **(report.metrics() if report is not None else {}),
            **drawn.source_metrics,
        })  # fmt: skip
        if "generate" in seconds:  # ahead of training, generation overlaps the rest
            generated = float(lengths.sum())
            metrics["perf/generate_tokens_per_s"] = generated / max(seconds["generate"], 1e-9)
        for stage in self.stages:
            metrics.update(stage.report(batch))
        return metrics

    # ---- validation, checkpoints, the run -----------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy decoding on the validation prompts (tasks): the source's metrics of it."""
        if not self.setup.val:
            return {}
        params = SamplingParams(temperature=0.0, max_new_tokens=self.config.sampling.max_new_tokens)
        return self.source.validate(params)

    def save(self, step: int) -> None:
        with self.checkpoints.writing(step):
            path = self.checkpoints.engine_staging_path(step)
            self.group.run_all(RoleWorker.save_checkpoint, path, step, self.trainable)
            self.checkpoints.publish(step, {**self.setup.state, "step": step, "time": time.time()})
        self.position.saved = step

    def resume(self, how: str, overwrite: bool) -> int:
        found = start_point(
            self.checkpoints, how, overwrite=overwrite, writer=True, console=self.console
        )
        if found is None:
            return 0
        adopt_checkpoint(found, self.setup.state, self.checkpoints)
        check_steps_left(found, self.config.run.steps, "run.steps")
        step = self.group.run_all(RoleWorker.load_checkpoint, found.engine_path, self.trainable)
        self.weights.sync(step)  # the rollouts generate with the checkpoint's weights
        self.console.print(f"resumed from {found.path} at step {step}")
        return step

    def _record(self, result: RLResult, done: int, metrics: Mapping[str, float]) -> None:
        """What the end-of-run summary keeps of step ``done``."""
        result.rewards[done], result.final_step = metrics["reward/mean"], done
        if "reward/task" in metrics:
            result.task_rewards[done] = metrics["reward/task"]
        digest = self.weights.reports[-1].sent.digest if self.weights.reports else None
        if digest is not None:
            result.weight_digests[done] = digest

    def fit(self, *, resume: str = "auto", overwrite: bool = False) -> RLResult:
        with owning(self.out, writer=True):  # before anything in out is read or cleaned
            return self._fit(resume, overwrite)

    def _fit(self, resume: str, overwrite: bool) -> RLResult:
        c = self.config
        began = time.perf_counter()
        self.checkpoints.clean_staging()
        start = self.resume(resume, overwrite)
        self.position = Position(self.checkpoints, start, start or None)
        result = RLResult(self.out, final_step=start)
        result.val_before = self.validate()
        if result.val_before:
            self.console.print(f"validation before: {fmt(result.val_before)}")
        logger = MetricsLogger(self.out, c.logging, run_config=self.setup.state, resume_step=start)
        try:
            # what the run built so far stays out of the collector's full passes in the loop
            with settled_heap():
                loop_began = time.perf_counter()
                self.source.start(start)
                self._train(start, result, logger, loop_began)
                result.loop_seconds = time.perf_counter() - loop_began
            self.source.stop()
            final = self.position.done  # run.steps, or earlier when run.max_seconds ran out
            self.save(final)
            result.val_after = self.validate()
            if result.val_after:
                logger.log(final, result.val_after)
                self.console.print(f"validation after: {fmt(result.val_after)}")
            if c.run.export_hf:
                result.hf_dir = self.out / "hf"
                self.group.run_all(RoleWorker.export_hf, str(result.hf_dir))
        finally:
            with contextlib.suppress(Exception):  # a failed run's own error is the one to see
                self.source.close()
            logger.close()
        series = [("reward/mean", "train reward"), ("val/reward", "validation reward")]
        plot_curve(self.out / METRICS_FILE, self.out / "reward_curve.png", series, ylabel="reward")
        result.seconds = time.perf_counter() - began
        return result

    def _train(self, start: int, result: RLResult, logger: MetricsLogger, began: float) -> None:
        """Steps ``start`` to ``run.steps`` (fewer when ``run.max_seconds`` runs out since
        ``began``), with mid-run validation and checkpoints."""
        c = self.config
        with TrainingProgress(
            c.run.steps, start, enabled=c.logging.progress, console=self.console,
            description="rl", metric="reward",
        ) as progress, run_signals(c.run, self.position, agree=False) as stop:  # fmt: skip
            for step in range(start, c.run.steps):
                if stop.requested():
                    raise stop_here(stop, self.position, self.save)
                metrics = self.step(step)
                done = self.position.done = step + 1
                self.alarm.check(done, metrics)
                if not math.isfinite(metrics["actor/loss"]):
                    raise FloatingPointError(f"actor loss is {metrics['actor/loss']} at {done}")
                if c.run.eval_every and done % c.run.eval_every == 0 and done < c.run.steps:
                    metrics.update(self.validate())
                logger.log(done, metrics)
                self._record(result, done, metrics)
                progress.update(
                    loss=metrics["reward/mean"],
                    tokens_per_s=metrics["perf/tokens_per_s"],
                    task=metrics.get("reward/task"),
                )
                if c.run.max_seconds and time.perf_counter() - began >= c.run.max_seconds:
                    if done < c.run.steps:
                        self.console.print(
                            f"run.max_seconds={c.run.max_seconds:g} spent: {done} steps"
                        )
                    break
                if c.run.save_every and done % c.run.save_every == 0 and done < c.run.steps:
                    self.save(done)
