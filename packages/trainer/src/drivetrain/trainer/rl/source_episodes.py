"""Multi-turn episodes as a step's samples (``env=<name>``, or an external agent with
``agent.command``): each task's ``n`` episodes are its group, their rewards the environment's
(or the agent's), placed on the turns that earned them."""

from __future__ import annotations

import shlex

from drivetrain.api import SamplingParams
from drivetrain.trainer.agentic.agent_runner import AgentRunner
from drivetrain.trainer.agentic.bounds import EpisodeBounds
from drivetrain.trainer.agentic.episodes import EpisodeRunner
from drivetrain.trainer.agentic.samples import episode_metrics, episode_samples
from drivetrain.trainer.rl.batch_ops import completions_batch
from drivetrain.trainer.rl.episode_setup import EpisodeSetup
from drivetrain.trainer.rl.sample_groups import generation_stats, split_groups
from drivetrain.trainer.rl.source import Drawn, PhaseTimer, Source, SourceContext
from drivetrain.trainer.rl.step_metrics import reward_stats


class Episodes(Source):
    """Episodes played each step (sync: the weights move as :class:`Source`'s do)."""

    def __init__(self, context: SourceContext, setup: EpisodeSetup) -> None:
        super().__init__(context)
        c, rollouts, tokenizer = context.config, context.rollouts, context.tokenizer
        self.runner: EpisodeRunner | AgentRunner
        if c.agent.command:
            self.runner = AgentRunner(
                rollouts,
                tokenizer,
                setup.parser,
                shlex.split(c.agent.command),
                context.scorer.agent_reward,
                setup.limits,
                timeout_s=c.agent.timeout_s,
                host=c.agent.host,
                port=c.agent.port,
            )
        else:
            assert setup.environment is not None
            self.runner = EpisodeRunner(
                rollouts,
                setup.environment,
                setup.parser,
                setup.chat,
                setup.limits,
                env_threads=c.episode.env_threads,
                step_timeout_s=c.episode.step_timeout_s,
                bounds=EpisodeBounds(
                    max_tool_calls=c.episode.max_tool_calls,
                    observation_chars=c.episode.max_observation_chars,
                ),
            )

    def draw(self, step: int, timer: PhaseTimer) -> Drawn:
        c = self.context
        prompts = c.step_prompts(step)
        with timer("generate"):
            played = self.runner.play(prompts, c.config.sampling.n, c.sampling(step))
        completions, scores = episode_samples(played)
        groups = split_groups(prompts, completions, scores, {})
        return Drawn(
            completions,
            completions_batch(completions, c.pad_token_id),
            scores,
            {**reward_stats(scores, {}), **generation_stats(groups)},
            source_metrics=episode_metrics(played),
            played=played,
        )

    def validate(self, params: SamplingParams) -> dict[str, float]:
        """One greedy episode per validation task: the mean reward and the episode metrics."""
        played = self.runner.play(self.context.val, 1, params)
        metrics = {"val/mean": sum(e.reward for e in played) / len(played)}
        for key, value in episode_metrics(played).items():
            metrics[f"val/{key}"] = value
        return metrics

    def close(self) -> None:
        self.runner.close()
