"""The RL loop: generate → reward → old/reference log-probs (and values) → advantages →
update → sync weights, once per step, driven from one controller over any placement."""

from __future__ import annotations

import contextlib
import math
import random
import shlex
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from drivetrain.api import Batch, OutputSpec, Prompt, SamplingParams
from drivetrain.api.columns import (
    ADVANTAGES,
    ENTROPY,
    LOG_PROBS,
    LOSS_MASK,
    OLD_LOG_PROBS,
    REF_LOG_PROBS,
    RETURNS,
    ROLLOUT_LOG_PROBS,
    TOKEN_WEIGHT_VERSION,
    VALUES,
)
from drivetrain.api.sync_manager import SyncReport
from drivetrain.trainer.agentic.agent_runner import AgentRunner
from drivetrain.trainer.agentic.episodes import EpisodeRunner
from drivetrain.trainer.agentic.job import EpisodeSetup
from drivetrain.trainer.agentic.samples import episode_metrics, episode_samples, turn_rewards
from drivetrain.trainer.checkpoints import CheckpointManager
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.metrics import METRICS_FILE, MetricsLogger, StepLog, plot_curve
from drivetrain.trainer.progress import TrainingProgress
from drivetrain.trainer.rl.advantages import ADVANTAGES as ESTIMATORS
from drivetrain.trainer.rl.advantages import AdvantageInputs
from drivetrain.trainer.rl.batch_ops import (
    completions_batch,
    engine_view,
    gather_outputs,
    group_ids,
    last_token_rewards,
    masked_mean,
    sample_versions,
    staleness_stats,
    stream_stats,
    taken_batch,
)
from drivetrain.trainer.rl.config import RLConfig, updates_per_step
from drivetrain.trainer.rl.dapo import (
    SHAPING,
    SampledGroup,
    dynamic_sample,
    filter_truncated,
    generation_stats,
    join_groups,
    overlong_penalty,
    split_groups,
)
from drivetrain.trainer.rl.group_stream import GroupStream
from drivetrain.trainer.rl.kl import kl_penalty
from drivetrain.trainer.rl.losses import OLD_VALUES, ActorLoss, CriticLoss, state_values
from drivetrain.trainer.rl.off_policy import CorrectionConfig
from drivetrain.trainer.rl.placement import Placement
from drivetrain.trainer.rl.policy_losses import ClipConfig
from drivetrain.trainer.rl.prompts import PromptSampler, RLPrompt
from drivetrain.trainer.rl.reference import Reference
from drivetrain.trainer.rl.rewards import RewardScorer
from drivetrain.trainer.rl.step_metrics import clip_ratio, fmt, mean_stats, reward_stats
from drivetrain.trainer.rl.worker import ACTOR, CRITIC, REWARD_MODEL, TEACHER, RLWorker
from drivetrain.trainer.run_dir import adopt_checkpoint, check_steps_left, start_point
from drivetrain.trainer.run_lock import owning
from drivetrain.trainer.stopping import Position, run_signals, stop_here
from drivetrain.trainer.workers.engine_worker import StepStats

TEACHER_LOG_PROBS = "teacher_log_probs"  # on-policy distillation: the teacher's, per token


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


#: async modes: one line per step, ``{"step", "trainer_version", "versions": [[first, last]]}``
#: (each trained sample's weight versions over its response tokens)
SAMPLES_FILE = "samples.jsonl"


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


class PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


class RLTrainer:
    def __init__(self, setup: RLSetup, placement: Placement, console: Console | None = None):
        self.setup, self.placement = setup, placement
        self.config = c = setup.config
        self.group, self.pool, self.weights = placement.group, placement.pool, placement.weights
        self.console = console or plain_console()
        self.scorer = RewardScorer(c.reward.functions, c.reward.weights)
        self.sampler = PromptSampler(len(setup.train), c.run.prompts_per_step, c.seed)
        alg = c.algorithm
        # the KL in the reward (and the teacher's reverse KL) needs the old log-probs here; the
        # off-policy correction takes
        # them from the update's own forward when it is the only one (the actor loss's)
        needs_old = (alg.kl_in_reward and setup.reference.enabled) or setup.teacher
        self.on_policy = alg.on_policy_shortcut and updates_per_step(c) == 1 and not needs_old
        self.actor_loss = ActorLoss(
            policy_loss=alg.policy_loss,
            clip=ClipConfig(alg.clip_low, alg.clip_high, alg.dual_clip),
            aggregation=alg.aggregation,
            max_length=c.sampling.max_new_tokens,
            entropy_coef=alg.entropy_coef,
            kl_loss_coef=alg.kl_coef if setup.reference.enabled and not alg.kl_in_reward else 0.0,
            kl_estimator=alg.kl_estimator,
            temperature=c.sampling.temperature,
            on_policy=self.on_policy,
            correction=alg.correction_name,
            correction_config=CorrectionConfig(
                alg.correction_cap, alg.correction_low, alg.correction_high
            ),
        )
        self.critic_loss = CriticLoss(alg.value_clip, alg.aggregation, c.sampling.max_new_tokens)
        self.trainable = (ACTOR, CRITIC) if setup.critic else (ACTOR,)
        self.out = Path(c.run.output_dir)
        self.checkpoints = CheckpointManager(
            self.out / "checkpoints", keep_last=c.run.keep_last, writer=True
        )
        self.position = Position(self.checkpoints)  # where the run is (for a stop)
        self.stream: GroupStream | None = None  # generation ahead of training (not sync mode)
        #: SAMPLES_FILE: each step's samples' weight versions (async modes)
        self.samples: StepLog | None = None
        self.episodes: EpisodeRunner | AgentRunner | None = None
        if setup.episodes is not None:
            e = setup.episodes
            if c.agent.command:
                self.episodes = AgentRunner(
                    self.pool.rollouts, setup.tokenizer, e.parser, shlex.split(c.agent.command),
                    self.agent_reward, e.limits, timeout_s=c.agent.timeout_s, host=c.agent.host,
                    port=c.agent.port,
                )  # fmt: skip
            else:
                assert e.environment is not None
                self.episodes = EpisodeRunner(
                    self.pool.rollouts, e.environment, e.parser, e.chat, e.limits,
                    workers=c.episode.workers, step_timeout_s=c.episode.step_timeout_s,
                )  # fmt: skip
        # a weight update aborts running requests, resumed under the new weights (partial
        # rollouts), or lets them finish under the old ones
        self.weights.abort_inflight = alg.mode == "async" and alg.partial_rollouts == "resume"

    # ---- the algorithm ------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step ``step`` (0-based): its metrics."""
        c, timer = self.config, PhaseTimer()
        alg = c.algorithm
        stream_metrics: dict[str, float] = {}
        played = None
        if self.episodes is not None:
            prompts = [self.setup.train[i] for i in self.sampler.indices(step)]
            with timer("generate"):
                played = self.episodes.play(prompts, c.sampling.n, self.sampling(step))
            completions, scores = episode_samples(played)
            parts: dict[str, list[float]] = {}
            stream_metrics = episode_metrics(played)
        elif self.stream is None:
            prompts = [self.setup.train[i] for i in self.sampler.indices(step)]
            with timer("generate"):
                completions = self.generate(prompts, step)
        else:
            with timer("wait_for_rollouts"):
                taken = self.stream.take(step)
            prompts, completions = taken_batch(taken, self.setup.train)
            stream_metrics = stream_stats(taken)
        if played is None:
            with timer("reward"):
                scores, parts = self.score(completions, prompts)
        groups = split_groups(prompts, completions, scores, parts)
        reward_metrics = {**reward_stats(scores, parts), **generation_stats(groups)}
        if alg.dynamic_sampling:
            with timer("dynamic_sampling"):
                sample = dynamic_sample(
                    groups,
                    partial(self.more_groups, step, []),
                    c.run.prompts_per_step,
                    alg.max_sampling_rounds,
                )
            prompts, completions, scores, parts = join_groups(sample.kept)
            reward_metrics = {
                **reward_stats(*join_groups(sample.generated)[2:]),  # what was generated
                **sample.metrics(),
            }
        batch = completions_batch(completions, self.setup.pad_token_id)
        lengths = batch[LOSS_MASK].sum(-1).float()
        if self.stream is not None:
            stream_metrics.update(self.staleness(batch, step))
        # sync: colocated rollouts sleep while the trainer uses their device; on leaving, the
        # new weights go to every rollout (the weight path's one sequence, every placement);
        # ahead of training, weights are pushed below, every sync_every steps
        updating = (
            self.weights.updating(step + 1) if self.stream is None else contextlib.nullcontext()
        )
        with updating:
            old: dict[str, torch.Tensor] = {}
            if not self.on_policy:  # else the update's own forward gives them
                with timer("old_log_probs"):
                    old = self.infer(batch, ACTOR, OutputSpec(entropy=True, temperature=self.temp))
                    batch = batch.with_columns(old_log_probs=old[LOG_PROBS])
            reference = self.setup.reference
            if reference.enabled:
                with timer("ref_log_probs"):
                    ref = self.infer(
                        batch,
                        reference.role,
                        OutputSpec(temperature=self.temp),
                        adapter_off=reference.adapter_off,
                    )
                    batch = batch.with_columns(ref_log_probs=ref[LOG_PROBS])
            if self.setup.teacher:
                with timer("teacher_log_probs"):
                    taught = self.infer(batch, TEACHER, OutputSpec(temperature=self.temp))
                    batch = batch.with_columns(
                        teacher_log_probs=taught[LOG_PROBS], token_keys=[TEACHER_LOG_PROBS]
                    )
            if self.setup.reward_model:
                with timer("reward_model"):
                    model_scores = self.reward_model_scores(batch)
                    scores = scores + model_scores
                    reward_metrics["reward/model_mean"] = float(model_scores.mean())
            if self.setup.critic:
                with timer("values"):
                    values = state_values(self.infer(batch, CRITIC, CriticLoss().outputs)[VALUES])
                    batch = batch.with_columns(old_values=values, token_keys=[OLD_VALUES])
            with timer("advantages"):
                placed = turn_rewards(batch, played) if played is not None else None
                batch, kl_metrics = self.advantages(batch, scores, placed)
            if alg.overlong_filter:  # after the advantages: truncated samples keep their
                # reward in their group's baseline, they only carry no loss
                batch, kl_metrics["response/overlong_filtered_frac"] = filter_truncated(
                    batch, completions
                )
            if self.setup.critic:
                with timer("update_critic"):
                    critic = self.update(batch, CRITIC, self.critic_loss, step, RETURNS, OLD_VALUES)
            with timer("update_actor"):
                actor = self.update(
                    batch, ACTOR, self.actor_loss, step, OLD_LOG_PROBS, ADVANTAGES, REF_LOG_PROBS,
                    ROLLOUT_LOG_PROBS, TOKEN_WEIGHT_VERSION,
                )  # fmt: skip
        report = self.weights.reports[-1] if self.stream is None else self.push_weights(step)
        if report is not None:
            timer.seconds["weight_sync"] = report.seconds
        mask = batch[LOSS_MASK]
        generated = float(lengths.sum())
        metrics = {
            **reward_metrics,
            **kl_metrics,
            "actor/grad_norm": actor.grad_norm,
            "actor/loss": actor.loss,
            "actor/lr": actor.lr,
            **actor.metrics,
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": clip_ratio(completions, lengths, c.sampling.max_new_tokens),
            "perf/tokens_per_s": float(batch.num_tokens) / sum(timer.seconds.values()),
            **{f"time/{k}_s": v for k, v in timer.seconds.items()},
            **(report.metrics() if report is not None else {}),
            **stream_metrics,
        }
        if "generate" in timer.seconds:  # ahead of training, generation overlaps the rest
            metrics["perf/generate_tokens_per_s"] = generated / max(timer.seconds["generate"], 1e-9)
        if old:
            metrics["actor/entropy_old"] = masked_mean(old[ENTROPY], mask)
            diff = (batch[ROLLOUT_LOG_PROBS] - batch[OLD_LOG_PROBS]).abs()
            metrics["rollout/log_prob_diff"] = masked_mean(diff, mask)
        if self.setup.critic:
            metrics.update({**critic.metrics, "critic/grad_norm": critic.grad_norm})
        return metrics

    def push_weights(self, step: int) -> SyncReport | None:
        """Ahead of training, after step ``step``: the scripted schedule's generation during
        the update, then the new weights every ``sync_every`` steps (their report; ``None``
        when none were sent)."""
        assert self.stream is not None
        alg = self.config.algorithm
        if alg.scripted_rounds:
            self.stream.advance(alg.scripted_rounds)
        if alg.mode == "async" and (step + 1) % alg.sync_every:
            return None
        report = self.weights.sync(step + 1)
        self.stream.weights_at(step + 1)
        return report

    @property
    def temp(self) -> float:
        return self.config.sampling.temperature

    def sampling(self, step: int, round_: int = 0) -> SamplingParams:
        """Step ``step``'s sampling; dynamic sampling's extra rounds get seeds of their own."""
        s = self.config.sampling
        seed = self.config.seed * 100_003 + step  # a resumed step samples the same way
        return SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_new_tokens=s.max_new_tokens,
            seed=seed if round_ == 0 else (seed * 1_009 + round_) % 2**62,
        )

    def generate(self, prompts: Sequence[RLPrompt], step: int, round_: int = 0) -> list[Any]:
        return self.pool.generate(
            [Prompt(token_ids=p.token_ids) for p in prompts], self.sampling(step, round_)
        )

    def more_groups(
        self, step: int, drawn: list[int], round_: int, count: int
    ) -> list[SampledGroup]:
        """Dynamic sampling's round ``round_``: ``count`` more prompts' groups, scored;
        ``drawn`` counts the step's extra prompts so far (one per round, appended)."""
        indices = self.sampler.extra(step, sum(drawn), count)
        drawn.append(len(indices))
        prompts = [self.setup.train[i] for i in indices]
        completions = self.generate(prompts, step, round_)
        return split_groups(prompts, completions, *self.score(completions, prompts))

    def score(
        self, completions: Sequence[Any], prompts: Sequence[RLPrompt], shaping: bool = True
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """Each sample's reward (the weighted reward functions, plus DAPO's overlong penalty
        when configured and ``shaping``) and each part's values."""
        decode = self.setup.tokenizer.decode
        totals, parts = [], {name: [] for name in self.scorer.names}
        for c in completions:
            text = decode(list(c.token_ids), skip_special_tokens=True)
            total, each = self.scorer(text, prompts[c.prompt_index].ground_truth)
            totals.append(total)
            for name, value in each.items():
                parts[name].append(value)
        scores = torch.tensor(totals, dtype=torch.float32)
        alg = self.config.algorithm
        if shaping and alg.overlong_buffer > 0:
            penalty = overlong_penalty(
                [len(c.token_ids) for c in completions],
                self.config.sampling.max_new_tokens,
                alg.overlong_buffer,
                alg.overlong_penalty,
            )
            scores = scores + penalty
            parts[SHAPING] = penalty.tolist()
        return scores, parts

    def agent_reward(self, task: Any, text: str) -> float:
        """An agent's episode that reported no reward: the reward functions on its last turn
        against the task's ``data.answer_key``."""
        answer = task.get(self.config.data.answer_key, "") if hasattr(task, "get") else ""
        return self.scorer(text, str(answer))[0]

    def infer(
        self, batch: Batch, role: str, spec: OutputSpec, adapter_off: bool = False
    ) -> dict[str, torch.Tensor]:
        return gather_outputs(self.group, engine_view(batch), role, spec, adapter_off)

    def reward_model_scores(self, batch: Batch) -> torch.Tensor:
        values = self.infer(batch, REWARD_MODEL, OutputSpec(log_probs=False, values=True))
        last = torch.as_tensor(batch.seq_lens) - 1
        return values[VALUES][torch.arange(len(batch)), last].float()

    def advantages(
        self, batch: Batch, scores: torch.Tensor, placed: torch.Tensor | None = None
    ) -> tuple[Batch, dict[str, float]]:
        """Advantages (and returns) of ``scores``, each on its sample's last token, or as
        ``placed`` per token (an episode's turn rewards)."""
        alg, mask = self.config.algorithm, batch[LOSS_MASK].float()
        rewards = last_token_rewards(batch, scores) if placed is None else placed
        metrics: dict[str, float] = {}
        if REF_LOG_PROBS in batch and not self.on_policy:
            # KL(old ‖ ref); on-policy, the old log-probs come from the update's own forward,
            # which reports it (the KL in the reward always has them: it turns on-policy off)
            kl = kl_penalty(batch[OLD_LOG_PROBS], batch[REF_LOG_PROBS], alg.kl_estimator)
            metrics["actor/kl_ref"] = masked_mean(kl, mask)
            if alg.kl_in_reward:
                rewards = rewards - alg.kl_coef * kl * mask
        if TEACHER_LOG_PROBS in batch:  # on-policy distillation: -coef x reverse KL per token
            reverse_kl = (batch[OLD_LOG_PROBS] - batch[TEACHER_LOG_PROBS]) * mask
            rewards = rewards - self.config.teacher.coef * reverse_kl
            metrics["distill/reverse_kl"] = masked_mean(reverse_kl, mask)
        inputs = AdvantageInputs(
            token_rewards=rewards,
            mask=mask,
            group_ids=group_ids(batch),
            values=batch.columns.get(OLD_VALUES),
            gamma=alg.gamma,
            lam=alg.lam,
            norm_by_std=alg.norm_by_std,
        )
        adv, returns = ESTIMATORS.get(alg.advantage)(inputs)
        metrics["advantages/abs_mean"] = masked_mean(adv.abs(), mask)
        return batch.with_columns(advantages=adv.float(), returns=returns.float()), metrics

    def update(self, batch: Batch, role: str, loss: Any, step: int, *columns: str) -> StepStats:
        """``ppo_epochs`` passes over the batch in mini-batches, one optimizer step each."""
        alg = self.config.algorithm
        view = engine_view(batch, *(c for c in columns if c in batch))
        size = alg.mini_batch_size or len(view)
        stats: list[StepStats] = []
        for epoch in range(alg.ppo_epochs):
            order = list(range(len(view)))
            if size < len(view):
                random.Random(self.config.seed * 7919 + step * 131 + epoch).shuffle(order)
            for start in range(0, len(order), size):
                mini = view.select(order[start : start + size])
                stats.append(self.group.run_sharded(RLWorker.train, mini, role, loss))
        return mean_stats(stats)

    # ---- validation, checkpoints, the run -----------------------------------------------
    def validate(self) -> dict[str, float]:
        """Greedy decoding on the validation prompts: mean reward and each function's mean."""
        if not self.setup.val:
            return {}
        params = SamplingParams(temperature=0.0, max_new_tokens=self.config.sampling.max_new_tokens)
        if self.episodes is not None:
            played = self.episodes.play(self.setup.val, 1, params)
            metrics = {"val/mean": sum(e.reward for e in played) / len(played)}
            for key, value in episode_metrics(played).items():
                metrics[f"val/{key}"] = value
            return metrics
        completions = self.pool.generate(
            [Prompt(token_ids=p.token_ids) for p in self.setup.val], params
        )
        metrics = reward_stats(*self.score(completions, self.setup.val, shaping=False))
        return {k.replace("reward/", "val/"): v for k, v in metrics.items() if k != "reward/std"}

    def group_stream(self, start: int) -> GroupStream:
        c, alg = self.config, self.config.algorithm
        return GroupStream(
            self.pool.rollouts,
            prompts=self.sampler.indices,
            prompt_ids=lambda i: self.setup.train[i].token_ids,
            params=self.sampling,
            per_step=c.run.prompts_per_step,
            steps=c.run.steps,
            max_staleness=alg.staleness,
            ordered=alg.mode == "one_step_off",
            drop_stale=alg.stale_samples == "drop",
            start_step=start,
            version=start,
            scripted_rounds=alg.scripted_rounds,
        )

    def close_stream(self) -> None:
        """Stop generating ahead (its running requests aborted): before the rollouts serve
        anything else, and at the end of the run, failed or not."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()

    def staleness(self, batch: Batch, step: int) -> dict[str, float]:
        """Generation ahead of training: how far the batch's tokens lag the weights of
        ``step``, and each sample's versions to the samples log (countable without this
        metric)."""
        if self.samples is not None:
            versions = sample_versions(batch)
            self.samples.write({"step": step + 1, "trainer_version": step, "versions": versions})
        return staleness_stats(batch, step)

    def save(self, step: int) -> None:
        with self.checkpoints.writing(step):
            path = self.checkpoints.engine_staging_path(step)
            self.group.run_all(RLWorker.save_checkpoint, path, step, self.trainable)
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
        step = self.group.run_all(RLWorker.load_checkpoint, found.engine_path, self.trainable)
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
        loop_began = time.perf_counter()
        if c.algorithm.mode != "sync":
            self.samples = StepLog(self.out / SAMPLES_FILE, resume_step=start)
            self.stream = self.group_stream(start)
            self.stream.start()
        try:
            with TrainingProgress(
                c.run.steps, start, enabled=c.logging.progress, console=self.console,
                description="rl", metric="reward",
            ) as progress, run_signals(c.run, self.position, agree=False) as stop:  # fmt: skip
                for step in range(start, c.run.steps):
                    if stop.requested():
                        raise stop_here(stop, self.position, self.save)
                    metrics = self.step(step)
                    done = self.position.done = step + 1
                    if not math.isfinite(metrics["actor/loss"]):
                        raise FloatingPointError(f"actor loss is {metrics['actor/loss']} at {done}")
                    if c.run.eval_every and done % c.run.eval_every == 0 and done < c.run.steps:
                        with self.stream.suspended() if self.stream else contextlib.nullcontext():
                            metrics.update(self.validate())
                    logger.log(done, metrics)
                    self._record(result, done, metrics)
                    progress.update(
                        loss=metrics["reward/mean"],
                        tokens_per_s=metrics["perf/tokens_per_s"],
                        task=metrics.get("reward/task"),
                    )
                    if c.run.save_every and done % c.run.save_every == 0 and done < c.run.steps:
                        self.save(done)
            result.loop_seconds = time.perf_counter() - loop_began
            self.close_stream()
            self.save(c.run.steps)
            result.val_after = self.validate()
            if result.val_after:
                logger.log(c.run.steps, result.val_after)
                self.console.print(f"validation after: {fmt(result.val_after)}")
            if c.run.export_hf:
                result.hf_dir = self.out / "hf"
                self.group.run_all(RLWorker.export_hf, str(result.hf_dir))
        finally:
            with contextlib.suppress(Exception):  # a failed run's own error is the one to see
                self.close_stream()
            if self.episodes is not None:
                with contextlib.suppress(Exception):
                    self.episodes.close()
            logger.close()
            if self.samples is not None:
                self.samples.close()
        series = [("reward/mean", "train reward"), ("val/reward", "validation reward")]
        plot_curve(self.out / METRICS_FILE, self.out / "reward_curve.png", series, ylabel="reward")
        result.seconds = time.perf_counter() - began
        return result
