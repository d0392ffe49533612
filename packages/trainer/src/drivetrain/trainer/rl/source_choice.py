"""The one place the run's mode is read: which :class:`Source` draws its samples."""

from __future__ import annotations

from pathlib import Path

from drivetrain.trainer.rl.episode_setup import EpisodeSetup
from drivetrain.trainer.rl.source import DynamicSampling, Source, SourceContext
from drivetrain.trainer.rl.source_ahead import GenerationAhead
from drivetrain.trainer.rl.source_episodes import Episodes


def choose_source(context: SourceContext, episodes: EpisodeSetup | None, out: Path) -> Source:
    """Episodes with an environment or agent; generation ahead of training in the async
    modes; else each step's groups generated when it asks, DAPO's dynamic sampling on top
    where configured (config refuses the combinations that do not fit)."""
    alg = context.config.algorithm
    if episodes is not None:
        return Episodes(context, episodes)
    if alg.mode == "one_step_off":  # one version behind, every step's weights pushed
        return GenerationAhead(
            context,
            out,
            ordered=True,
            max_staleness=alg.staleness,
            sync_every=1,
            resume_partial=False,
        )
    if alg.mode == "async":
        return GenerationAhead(
            context,
            out,
            ordered=False,
            max_staleness=alg.staleness,
            sync_every=alg.ahead.sync_every,
            resume_partial=alg.ahead.partial_rollouts == "resume",
        )
    if alg.dapo.dynamic_sampling:
        return DynamicSampling(context)
    return Source(context)
