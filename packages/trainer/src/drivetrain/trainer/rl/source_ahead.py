"""Generation ahead of training (``algorithm.mode`` one_step_off or async): a
:class:`~drivetrain.trainer.rl.group_stream.GroupStream` generates groups while the trainer
trains; a step takes the groups the staleness bound admits, and the new weights are pushed
after the update, every ``sync_every`` steps."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from drivetrain.api import SamplingParams
from drivetrain.trainer.metrics import StepLog
from drivetrain.trainer.rl.batch_ops import (
    mark_current_weights,
    sample_versions,
    staleness_stats,
    stream_stats,
    taken_batch,
)
from drivetrain.trainer.rl.group_stream import GroupStream
from drivetrain.trainer.rl.source import Drawn, PhaseTimer, Source, SourceContext
from drivetrain.trainer.rl.sync_manager import SyncReport

#: one line per step, ``{"step", "trainer_version", "versions": [[first, last]]}`` (each trained
#: sample's weight versions over its response tokens)
SAMPLES_FILE = "samples.jsonl"


class GenerationAhead(Source):
    """Groups generated ahead of training, at most ``max_staleness`` versions behind."""

    def __init__(
        self,
        context: SourceContext,
        out: Path,
        *,
        ordered: bool,
        max_staleness: int,
        sync_every: int,
        resume_partial: bool,
    ) -> None:
        super().__init__(context)
        self.out, self.ordered, self.max_staleness = out, ordered, max_staleness
        self.sync_every = sync_every
        # a weight update aborts running requests, resumed under the new weights (partial
        # rollouts), or lets them finish under the old ones
        context.weights.abort_inflight = resume_partial
        self.stream: GroupStream | None = None
        self.samples: StepLog | None = None  # SAMPLES_FILE

    def start(self, step: int) -> None:
        c, alg = self.context.config, self.context.config.algorithm
        self.samples = StepLog(self.out / SAMPLES_FILE, resume_step=step)
        self.stream = GroupStream(
            self.context.rollouts,
            prompts=self.context.sampler.indices,
            prompt_ids=lambda i: self.context.train[i].token_ids,
            params=self.context.sampling,
            per_step=c.run.prompts_per_step,
            steps=c.run.steps,
            max_staleness=self.max_staleness,
            ordered=self.ordered,
            drop_stale=alg.ahead.stale_samples == "drop",
            stale_from_last_token=alg.ahead.staleness_from == "last_token",
            start_step=step,
            version=step,
            scripted_rounds=alg.ahead.scripted_rounds,
            background=alg.ahead.background_generation,
        )
        self.stream.start()

    def draw(self, step: int, timer: PhaseTimer) -> Drawn:
        assert self.stream is not None and self.samples is not None, "start() first"
        with timer("wait_for_rollouts"):
            taken = self.stream.take(step)
        prompts, completions = taken_batch(taken, self.context.train)
        drawn = self.context.drawn(prompts, completions, timer)
        # how far the tokens lag the weights of ``step``; each sample's versions go to the
        # samples log too (countable without this metric)
        versions = sample_versions(drawn.batch)
        self.samples.write({"step": step + 1, "trainer_version": step, "versions": versions})
        drawn.source_metrics = {**stream_stats(taken), **staleness_stats(drawn.batch, step)}
        drawn.batch = mark_current_weights(drawn.batch, step)
        return drawn

    def training(self, step: int) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the weights move after the update (weights_after)

    def weights_after(self, step: int) -> SyncReport | None:
        """The scripted schedule's generation during the update, then the new weights every
        ``sync_every`` steps."""
        assert self.stream is not None
        rounds = self.context.config.algorithm.ahead.scripted_rounds
        if rounds:
            self.stream.advance(rounds)
        if (step + 1) % self.sync_every:
            return None
        report = self.context.weights.sync(step + 1)
        self.stream.weights_at(step + 1)
        return report

    def validate(self, params: SamplingParams) -> dict[str, float]:
        """Mid-run, the stream's requests are aborted meanwhile and resumed afterwards."""
        with self.stream.suspended() if self.stream else contextlib.nullcontext():
            return super().validate(params)

    def stop(self) -> None:
        """Its running requests aborted: before the rollouts serve anything else."""
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            if self.samples is not None:
                self.samples.close()
