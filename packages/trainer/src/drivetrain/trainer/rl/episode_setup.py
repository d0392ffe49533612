"""What an RL job with ``env=<name>`` decides before any worker starts: the environment, its
tasks, the chat tokens and the episode limits, every check done here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from drivetrain.api import registry
from drivetrain.api.environment import Environment, Task
from drivetrain.api.errors import ConfigError, DrivetrainError, PluginError
from drivetrain.trainer.agentic.chat_tokens import ChatTokens
from drivetrain.trainer.agentic.episodes import EpisodeLimits
from drivetrain.trainer.agentic.tool_parsers import ToolParser, tool_parser
from drivetrain.trainer.data.files import iter_rows
from drivetrain.trainer.errors import DataError, said
from drivetrain.trainer.preflight import Context
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.prompts import missing_ground_truth, row_ground_truth
from drivetrain.trainer.rl.rewards import uses_ground_truth

#: validation tasks an environment makes when data.val_size does not say
DEFAULT_VAL_TASKS = 64


@dataclass(frozen=True)
class EpisodeSetup:
    environment: Environment | None  # None: an agent (agent.command) plays data rows
    parser: ToolParser
    chat: ChatTokens
    limits: EpisodeLimits
    train: list[Task]
    val: list[Task]


def load_environment(config: RLConfig) -> Environment:
    """The job's environment, built with ``episode.options``; bad options are config errors,
    anything else it raises a plugin error (one line, naming it)."""
    factory = registry.environments.load(config.env)
    try:
        return factory(dict(config.episode.options))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"env={config.env}: episode.options: {exc}") from exc
    except DrivetrainError:
        raise
    except Exception as exc:
        raise PluginError(
            f"env={config.env}: the environment raised when built: {said(exc)}"
        ) from exc


def episode_setup(config: RLConfig, tokenizer: Any, context: Context) -> EpisodeSetup:
    environment = load_environment(config) if config.env else None
    if environment is None and not config.data.train_path:
        raise ConfigError("agent.command without env needs data.train_path (a task per row)")
    try:
        parser = tool_parser(config.episode.tool_parser)
    except ValueError as exc:
        raise ConfigError(f"episode.tool_parser: {exc}") from exc
    data = config.data
    train = _tasks(environment, data.train_path, "train", config.episode.train_tasks, config)
    train = train[: data.max_prompts or None]
    val_count = data.val_size or DEFAULT_VAL_TASKS
    val = _tasks(environment, data.val_path, "val", val_count, config)[:val_count]
    if config.run.prompts_per_step > len(train):
        raise ConfigError(
            f"run.prompts_per_step={config.run.prompts_per_step} exceeds the {len(train)} tasks"
        )
    limits = EpisodeLimits(
        max_turns=config.episode.max_turns,
        turn_tokens=config.sampling.max_new_tokens,
        episode_tokens=config.episode.max_tokens,
        context=context.tokens,
    )
    chat = ChatTokens(tokenizer, _tools(environment, config))
    return EpisodeSetup(environment, parser, chat, limits, train, val)


def _tools(environment: Environment | None, config: RLConfig) -> list[Any]:
    """The environment's tool schemas (none without one); what it raises is one line."""
    if environment is None:
        return []
    try:
        return list(environment.tools())
    except Exception as exc:
        raise PluginError(f"env={config.env}: its tools() raised {said(exc)}") from exc


def _tasks(
    environment: Environment | None, path: str, split: str, count: int, config: RLConfig
) -> list[Task]:
    """Rows of ``path`` as tasks; without a path, the environment's own (none for ``val``
    when it makes none: validation is optional)."""
    if path:
        rows = list(iter_rows(path))
        if not rows:
            raise DataError(f"{path}: no tasks")
        if config.agent.command:
            _check_ground_truths(rows, config)
        return [row for _, row in rows]
    if environment is None:
        return []
    try:
        return list(environment.tasks(split, count, config.seed))
    except NotImplementedError as exc:
        if split == "val":
            return []
        raise ConfigError(f"env={config.env}: {exc}") from exc
    except DrivetrainError:
        raise
    except Exception as exc:
        raise PluginError(f"env={config.env}: its tasks({split!r}) raised {said(exc)}") from exc


def _check_ground_truths(rows: list[tuple[str, dict[str, Any]]], config: RLConfig) -> None:
    """An agent's episode that reports no reward is scored by the reward functions against its
    row's ground truth (``SampleScorer.agent_reward``): a row without one would score 0 every
    step, silently, so it is refused here, before any worker starts."""
    reward, data = config.reward, config.data
    if not uses_ground_truth(reward.functions, reward.weights):
        return
    for where, row in rows:
        if row_ground_truth(row, data.answer_key, data.messages_key) is None:
            raise DataError(
                f"{missing_ground_truth(where, data.answer_key, data.messages_key)}, which "
                f"reward.functions={list(reward.functions)} check the agent's answer against; "
                "add one, or, when the agent reports its own rewards, weigh them 0 "
                "(reward.weights)"
            )
