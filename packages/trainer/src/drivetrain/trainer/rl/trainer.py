"""The RL job: a source draws each step's scored samples, stages add what the updates
need (old and reference log-probs, values, advantages), the updates run, and the source moves
the weights; driven from one controller over any placement (the run around the steps is
:mod:`drivetrain.trainer.run_loop`'s)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api import ConfigError, SamplingParams
from drivetrain.api.columns import LOSS_MASK
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.diagnose import log_prob_tolerance
from drivetrain.trainer.metrics import Curve
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.episode_setup import EpisodeSetup
from drivetrain.trainer.rl.log_prob_alarm import METRIC as LOG_PROB_GAP
from drivetrain.trainer.rl.log_prob_alarm import LogProbAlarm
from drivetrain.trainer.rl.placement import Placement
from drivetrain.trainer.rl.prompts import PromptSampler
from drivetrain.trainer.rl.routing import expert_count, load_metrics, replay_column
from drivetrain.trainer.rl.scoring import SampleScorer
from drivetrain.trainer.rl.source import Drawn, PhaseTimer, SourceContext
from drivetrain.trainer.rl.source_choice import choose_source
from drivetrain.trainer.rl.stages import StepBatch, build_stages
from drivetrain.trainer.rl.step_metrics import clip_ratio, fmt
from drivetrain.trainer.rl.sync_manager import SyncReport
from drivetrain.trainer.rl.updates import build_updates, on_policy
from drivetrain.trainer.run_loop import Job, LoopSpec, Outcome
from drivetrain.trainer.workers.engine_worker import StepStats


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


REWARD_CURVE = Curve(
    "reward_curve.png",
    (("reward/mean", "train reward"), ("val/reward", "validation reward")),
    "reward",
)


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
    #: step -> the rollout-vs-trainer log-prob gap: token mean and largest token
    log_prob_gaps: dict[int, tuple[float, float]] = field(default_factory=dict)
    log_prob_alarm: float = 0.0  # the threshold the run's alarm used (< 0: off)


class RLTrainer(Job[RLResult]):
    def __init__(self, setup: RLSetup, placement: Placement, console: Console | None = None):
        self.setup, self.placement = setup, placement
        self.config = c = setup.config
        self.group, self.rollouts, self.weights = (
            placement.group,
            placement.rollouts,
            placement.weights,
        )
        self.console = console or plain_console()
        self.out = Path(c.run.output_dir)
        context = SourceContext(
            c,
            setup.train,
            setup.val,
            setup.tokenizer,
            setup.pad_token_id,
            self.rollouts,
            self.weights,
            PromptSampler(len(setup.train), c.run.prompts_per_step, c.seed),
            SampleScorer(c, setup.tokenizer),
        )
        self.source = choose_source(context, setup.episodes, self.out)
        reference = setup.reference
        self.on_policy = on_policy(c, reference.enabled, setup.teacher)
        if self.on_policy and c.algorithm.routing_replay == "old_policy":
            raise ConfigError(
                "algorithm.routing_replay=old_policy replays the old log-probs' routing in a "
                "step's later updates, but this run makes one update per step (its own forward "
                "is the old policy): use rollout, or several updates (algorithm.ppo_epochs)"
            )
        self.stages = build_stages(
            c,
            self.group,
            on_policy=self.on_policy,
            reference=reference,
            teacher=setup.teacher,
            reward_model=setup.reward_model,
            critic=setup.critic,
        )
        self.updates = build_updates(c, on_policy=self.on_policy, critic=setup.critic)
        self.spec = LoopSpec(
            name="rl",
            total=c.run.steps,
            steps_knob="run.steps",
            run=c.run,
            logging=c.logging,
            state=setup.state,
            identity=setup.state,
            headline="reward/mean",
            metric_word="reward",
            tokens_per_s="perf/tokens_per_s",
            curve=REWARD_CURVE,
            validate_before=True,
            validation_label="validation",
            max_seconds=c.run.max_seconds,
        )
        threshold = c.run.log_prob_alarm or log_prob_tolerance(c.actor.model.dtype, c.rollout.dtype)
        exact = c.numerics == "exact"
        self.alarm = LogProbAlarm(threshold, self.console.print, exact=exact)
        # what record() keeps of each step; under exact numerics any gap fires the alarm
        said = 0.0 if exact and threshold >= 0 else threshold
        self.kept = RLResult(self.out, final_step=0, log_prob_alarm=said)

    # ---- the algorithm ------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step ``step`` (0-based): the source's samples through the stages, the updates,
        the weights moved; its metrics."""
        timer = PhaseTimer()
        drawn = self.source.draw(step, timer)
        replayed = replay_column(drawn.batch, self.config.algorithm.routing_replay)
        batch = StepBatch(
            replayed, drawn.scores, drawn.completions, drawn.played, drawn.reward_metrics
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
        metrics.update(
            {
                "response/length_mean": float(lengths.mean()),
                "response/length_max": float(lengths.max()),
                "response/clip_ratio": clip_ratio(drawn.completions, lengths, max_new),
                "perf/tokens_per_s": float(batch.batch.num_tokens) / sum(seconds.values()),
                **{f"time/{k}_s": v for k, v in seconds.items()},
                **(report.metrics() if report is not None else {}),
                **drawn.source_metrics,
            }
        )
        if "generate" in seconds:  # ahead of training, generation overlaps the rest
            generated = float(lengths.sum())
            metrics["perf/generate_tokens_per_s"] = generated / max(seconds["generate"], 1e-9)
        for stage in self.stages:
            metrics.update(stage.report(batch))
        if self.config.rollout.return_routed_experts:
            experts = expert_count(self.config.actor.model.path)
            metrics.update(load_metrics(batch.batch, experts))
        return metrics

    def run_step(self, step: int) -> dict[str, float]:
        """:meth:`step`, then its alarms: the log-prob gap, a non-finite loss."""
        metrics = self.step(step)
        done = step + 1
        self.alarm.check(done, metrics)
        if not math.isfinite(metrics["actor/loss"]):
            raise FloatingPointError(f"actor loss is {metrics['actor/loss']} at {done}")
        return metrics

    # ---- validation, checkpoints, the run -----------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy decoding on the validation prompts (tasks): the source's metrics of it."""
        if not self.setup.val:
            return {}
        params = SamplingParams(temperature=0.0, max_new_tokens=self.config.sampling.max_new_tokens)
        return self.source.validate(params)

    def describe(self, metrics: Mapping[str, float]) -> str:
        return fmt(metrics)

    def load(self, engine_path: str) -> int:
        step = super().load(engine_path)
        self.weights.sync(step)  # the rollouts generate with the checkpoint's weights
        return step

    def record(self, done: int, metrics: Mapping[str, float]) -> None:
        """What the end-of-run summary keeps of step ``done``."""
        kept = self.kept
        if "reward/task" in metrics:
            kept.task_rewards[done] = metrics["reward/task"]
        if LOG_PROB_GAP in metrics:
            gap = metrics[LOG_PROB_GAP]
            kept.log_prob_gaps[done] = (gap, metrics.get(f"{LOG_PROB_GAP}_max", gap))
        digest = self.weights.reports[-1].sent.digest if self.weights.reports else None
        if digest is not None:
            kept.weight_digests[done] = digest

    def begin(self, start: int) -> None:
        self.source.start(start)

    def end(self) -> None:
        self.source.stop()

    def close(self) -> None:
        self.source.close()

    def result(self, outcome: Outcome) -> RLResult:
        moved = ("final_step", "val_before", "val_after", "hf_dir", "seconds", "loop_seconds")
        taken = {name: getattr(outcome, name) for name in moved}
        return dataclasses.replace(self.kept, rewards=outcome.headlines, **taken)
