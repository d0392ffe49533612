"""Where a step's samples come from: a :class:`Source`, chosen once when the run starts
(``rl/source_choice.py``). The loop asks it for each step's scored samples and lets it own what the
weights do around the update; here the sync ones, generating each step's groups when the step
asks (DAPO's dynamic sampling on top of it)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from drivetrain.api import Batch, Prompt, SamplingParams
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.rl.batch_ops import completions_batch
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.dapo import dynamic_sample
from drivetrain.trainer.rl.prompts import PromptSampler, RLPrompt
from drivetrain.trainer.rl.sample_groups import (
    SampledGroup,
    generation_stats,
    join_groups,
    split_groups,
)
from drivetrain.trainer.rl.scoring import SampleScorer
from drivetrain.trainer.rl.step_metrics import reward_stats
from drivetrain.trainer.rl.sync_manager import SyncReport, WeightSyncManager


class PhaseTimer:
    """Seconds per named phase of one step (``time/<phase>_s``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str | None) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if phase is not None:  # an untimed phase
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class Drawn:
    """One step's samples, scored, as the stages take them."""

    completions: Sequence[Any]  # prompt_index: the completion's prompt's place in the step
    batch: Batch
    scores: torch.Tensor  # [B] each sample's reward
    reward_metrics: dict[str, float]  # reward/*, sampling/*: what was generated and scored
    source_metrics: dict[str, float] = field(default_factory=dict)  # async/*, episode/*
    played: Sequence[Any] | None = None  # episodes: their turn rewards land per token


@dataclass(frozen=True)
class SourceContext:
    """What every source draws from; built by the trainer before the run."""

    config: RLConfig
    train: Sequence[Any]  # RLPrompts, or an environment's tasks
    val: Sequence[Any]
    tokenizer: Any
    pad_token_id: int
    rollouts: RolloutService  # the placement's: every generation goes through it
    weights: WeightSyncManager
    sampler: PromptSampler
    scorer: SampleScorer

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

    def drawn(self, prompts: Sequence[Any], completions: Sequence[Any], timer: PhaseTimer) -> Drawn:
        """``completions`` of ``prompts`` scored, batched, with their reward statistics."""
        with timer("reward"):
            scores, parts = self.scorer(completions, prompts)
        groups = split_groups(prompts, completions, scores, parts)
        return Drawn(
            completions,
            completions_batch(completions, self.pad_token_id),
            scores,
            {**reward_stats(scores, parts), **generation_stats(groups)},
        )

    def step_prompts(self, step: int) -> list[Any]:
        return [self.train[i] for i in self.sampler.indices(step)]


class Source:
    """A step's samples, and the weights around its update. This base generates each step's
    groups when the step asks (sync): the update runs inside the weights' update sequence,
    after which every rollout holds the new weights."""

    def __init__(self, context: SourceContext) -> None:
        self.context = context

    def start(self, step: int) -> None:
        """The run (re)starts at ``step``."""

    def draw(self, step: int, timer: PhaseTimer) -> Drawn:
        return self.context.drawn(*self.step_samples(step, timer), timer)

    def step_samples(self, step: int, timer: PhaseTimer) -> tuple[list[Any], list[Any]]:
        """Step ``step``'s prompts and their completions, generated now."""
        prompts = self.context.step_prompts(step)
        with timer("generate"):
            return prompts, self.generate(prompts, step)

    def generate(self, prompts: Sequence[RLPrompt], step: int, round_: int = 0) -> list[Any]:
        params = self.context.sampling(step, round_)
        return self.context.rollouts.generate(
            [Prompt(token_ids=p.token_ids) for p in prompts], params
        )

    def training(self, step: int) -> AbstractContextManager[Any]:
        """Around step ``step``'s stages and updates: colocated rollouts sleep while the
        trainer uses their device; on leaving, the new weights go to every rollout."""
        return self.context.weights.updating(step + 1)

    def weights_after(self, step: int) -> SyncReport | None:
        """The weights sent after step ``step``'s update (``None``: none were)."""
        return self.context.weights.reports[-1]

    def validate(self, params: SamplingParams) -> dict[str, float]:
        """``params`` on the validation prompts: the mean reward and each function's mean."""
        c = self.context
        prompts = [Prompt(token_ids=p.token_ids) for p in c.val]
        completions = c.rollouts.generate(prompts, params)
        metrics = reward_stats(*c.scorer(completions, c.val, shaping=False))
        return {k.replace("reward/", "val/"): v for k, v in metrics.items() if k != "reward/std"}

    def stop(self) -> None:
        """Nothing more is generated for training (before the final save and validation)."""

    def close(self) -> None:
        """The run is over, failed or not."""
        self.stop()


class DynamicSampling(Source):
    """DAPO's dynamic sampling over the sync source: groups whose samples all got the same
    reward are replaced by more prompts' groups, up to ``max_sampling_rounds`` calls."""

    def draw(self, step: int, timer: PhaseTimer) -> Drawn:
        c, alg = self.context, self.context.config.algorithm
        prompts, completions = self.step_samples(step, timer)
        with timer("reward"):
            first = split_groups(prompts, completions, *c.scorer(completions, prompts))
        with timer("dynamic_sampling"):
            more = partial(self._more_groups, step, [])
            per_step = c.config.run.prompts_per_step
            sample = dynamic_sample(first, more, per_step, alg.dapo.max_sampling_rounds)
        _, completions, scores, _ = join_groups(sample.kept)
        metrics = {**reward_stats(*join_groups(sample.generated)[2:]), **sample.metrics()}
        return Drawn(completions, completions_batch(completions, c.pad_token_id), scores, metrics)

    def _more_groups(
        self, step: int, drawn: list[int], round_: int, count: int
    ) -> list[SampledGroup]:
        """Round ``round_``: ``count`` more prompts' groups, scored; ``drawn`` counts the
        step's extra prompts so far (one entry per round)."""
        c = self.context
        indices = c.sampler.extra(step, sum(drawn), count)
        drawn.append(len(indices))
        prompts = [c.train[i] for i in indices]
        completions = self.generate(prompts, step, round_)
        return split_groups(prompts, completions, *c.scorer(completions, prompts))
