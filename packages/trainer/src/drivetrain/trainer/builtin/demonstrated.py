"""The built-in warm start of any environment that demonstrates its task: ``drivetrain grpo
env=NAME`` with no ``actor.model.path``, for an environment whose class implements
:meth:`~drivetrain.api.environment.Environment.demonstration`.

No CPU-sized tool-using chat model exists offline, so drivetrain makes one as it does for
``env=calculator`` (:mod:`~drivetrain.trainer.builtin.tool_warm_start`): a character tokenizer
whose chat template names each tool with its parameters (a model learns which argument to
fill) and writes Hermes ``<tool_call>`` markers, with the demonstrations' frequent words as
single tokens; a tiny Llama; and a short SFT on episodes played from the demonstrations. Each
demonstrated turn is written in the Hermes markup, parsed back and stepped through the
environment's ``reset``/``step`` as the trainer does during RL, so the SFT rows hold the
environment's real observations; only episodes that end with a reward > 0 are kept.

The warm start must leave GRPO something to raise, and every demonstration it keeps earns a
reward, so the imperfection is the annotator's, as the calculator's slips are: a share
``SHORTCUT`` of the episodes answer at once, without the turns before the answer, where the
environment still rewards that. The model learns the tool protocol and the shortcut; GRPO
keeps whichever pays (``demonstrated_grpo.yaml``).

Everything is cached under ``$DRIVETRAIN_CACHE/demonstrated-v1/<env>-<version>-<hash>``: the
environment's name, its distribution's version and a hash of the played demonstrations (and
of the recipe: model shape, template, SFT settings), so a changed environment or task gets a
new warm start and an unchanged one is trained once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import random
import re
import string
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.api.environment import AssistantTurn, Environment, Message, Task
from drivetrain.api.errors import ConfigError, DrivetrainError, PluginError
from drivetrain.trainer.agentic.tool_parsers import HermesParser
from drivetrain.trainer.builtin.addition import cache_dir
from drivetrain.trainer.builtin.build_once import build_once
from drivetrain.trainer.builtin.tool_warm_start import (
    HERMES_MARKERS,
    ToolTaskAssets,
    build_tool_model,
    chat_template,
    ensure_sft_model,
)
from drivetrain.trainer.data.files import iter_rows
from drivetrain.trainer.errors import said
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.episode_setup import load_environment

HERE = Path(__file__).parent
#: the recipe: a change to what is built here (template, words, shape) bumps it
ASSETS_VERSION = "demonstrated-v1"
SFT_CONFIG = HERE / "demonstrated_sft.yaml"
GRPO_CONFIG = HERE / "demonstrated_grpo.yaml"
#: tasks demonstrated for the SFT (its 150 steps of 32 read each about twice), with a seed of
#: their own, so they are not the RL job's tasks (seed 0 by default)
SFT_TASKS = 2048
SFT_SEED = 7919
#: share of demonstrations a careless annotator shortcuts: the last turn alone (the answer,
#: no tool call). Where the model cannot answer alone the shortcut fails and GRPO trains it
#: out (the calculator's guesses); where it can (the template's short sentences) GRPO keeps it
SHORTCUT = 0.4
MODEL_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}
#: each tool as ``name(param,param)``: the model sees which arguments a call takes
EACH_TOOL = (
    " {{ t['function']['name'] }}({% for p in (t['function']['parameters'] or {}).get("
    "'properties') or {} %}{{ p }}{% if not loop.last %},{% endif %}{% endfor %})"
)
#: the demonstrations' most frequent words (runs of letters) that become single tokens
FREQUENT_WORDS = 256
_WORD = re.compile(r"[A-Za-z]{2,}")
#: characters the character tokenizer has; others in the demonstrations become tokens too
_CHARACTERS = set(string.printable) - set("\t\n\r\x0b\x0c")
_PARSER = HermesParser()


def demonstrates(environment: type[Environment]) -> bool:
    """Whether the class implements ``demonstration`` (the default demonstrates nothing)."""
    return environment.demonstration is not Environment.demonstration


def refusal(config: RLConfig, environment: type[Environment]) -> ConfigError:
    """One line: what a job with this environment and no model needs."""
    return ConfigError(
        f"actor.model.path is required with env={config.env}: set it to a chat model whose "
        f"template renders tools, or implement {environment.__name__}.demonstration(task) so "
        "drivetrain warms a tiny built-in model up on it (docs/plugin-authors.md, section "
        '"Environments")'
    )


def written(turn: AssistantTurn) -> str:
    """The turn as the built-in model writes it: its content, then its calls in Hermes."""
    calls = _PARSER.format(turn.tool_calls) if turn.tool_calls else ""
    return turn.content + calls


def play(environment: Environment, task: Task, turns: Sequence[AssistantTurn]) -> list[Message]:
    """The conversation of ``turns`` played through an episode of ``task``, each turn written
    and parsed back as the trainer parses the policy's; empty unless it ends at the last
    turn with a reward > 0."""
    episode = environment.episode(task)
    messages = [dict(m) for m in episode.reset()]
    earned = 0.0
    for index, turn in enumerate(turns):
        text = written(turn)
        parsed = _PARSER.parse(text)
        result = episode.step(
            AssistantTurn(index, text, parsed.content, parsed.tool_calls, parsed.errors)
        )
        messages.append({"role": "assistant", "content": text})
        earned += result.reward
        if result.done:
            return messages if earned > 0 and index == len(turns) - 1 else []
        messages.extend(dict(m) for m in result.observations)
    return []


def _tasks(environment: Environment, config: RLConfig) -> list[Task]:
    """The tasks to demonstrate: the environment's own, else the job's data rows."""
    try:
        return list(environment.tasks("train", SFT_TASKS, SFT_SEED))
    except NotImplementedError:
        if not config.data.train_path:
            raise ConfigError(
                f"env={config.env} makes no tasks of its own: set data.train_path"
            ) from None
    return [row for _, row in itertools.islice(iter_rows(config.data.train_path), SFT_TASKS)]


def careless(
    environment: Environment, task: Task, turns: Sequence[AssistantTurn], rng: random.Random
) -> list[Message]:
    """The demonstration as a careless annotator plays it: a ``SHORTCUT`` share of them
    answer at once, without the turns before the answer (no tool call), when that episode
    still earns a reward (the annotator knew the answer; the model must guess it)."""
    if len(turns) > 1 and rng.random() < SHORTCUT:
        shortcut = play(environment, task, [dataclasses.replace(turns[-1], index=0)])
        if shortcut:
            return shortcut
    return play(environment, task, turns)


def demonstration_rows(environment: Environment, config: RLConfig) -> list[dict[str, Any]]:
    """SFT chat rows (``messages``, ``tools``) of the rewarded demonstrated episodes."""
    tools = [dict(t) for t in environment.tools()]
    rows = []
    rng = random.Random(SFT_SEED)
    for task in _tasks(environment, config):
        try:
            turns = environment.demonstration(task)
            messages = careless(environment, task, turns, rng) if turns else []
        except DrivetrainError:
            raise
        except Exception as exc:
            raise PluginError(
                f"env={config.env}: its demonstration of a task raised {said(exc)}"
            ) from exc
        if messages:
            rows.append({"messages": messages, "tools": tools})
    if not rows:
        raise ConfigError(
            f"env={config.env}: none of its demonstrations earned a reward (each must end the "
            "episode at its last turn with a reward > 0; the environment kit checks them)"
        )
    return rows


def words(tools: Sequence[Mapping[str, Any]], rows: list[dict[str, Any]]) -> tuple[str, ...]:
    """Single tokens, as a BPE vocabulary merges frequent strings (the tiny model copies a
    word, not its letters): the Hermes markers, each tool's name and the JSON that opens its
    call, each parameter's key, the demonstrations' most frequent words, and any character
    the tokenizer lacks."""
    found = list(HERMES_MARKERS)
    for tool in tools:
        function = tool.get("function") or {}
        name = str(function.get("name", ""))
        found += [name, '{"name":' + json.dumps(name) + ',"arguments":{']
        properties = (function.get("parameters") or {}).get("properties") or {}
        found += [json.dumps(str(p)) + ":" for p in properties]
    found.append("}}")
    texts = [m["content"] for row in rows for m in row["messages"]]
    counts = collections.Counter(w for text in texts for w in _WORD.findall(text))
    frequent = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:FREQUENT_WORDS]
    found += [w for w, count in frequent if count > 1]
    found += sorted(set("".join(texts)) - _CHARACTERS)
    return tuple(dict.fromkeys(w for w in found if w))


def _version(env: str) -> str:
    """The version of the distribution that declares ``env`` (its entry point)."""
    for ep in metadata.entry_points(group="drivetrain.environments", name=env):
        if ep.dist is not None:
            return ep.dist.version
    return "0"


def ensure_warm_start(
    config: RLConfig, console: Console | None, *, engine: str, train: bool
) -> tuple[ToolTaskAssets, Path]:
    """The cached assets and SFT model of ``config.env``'s demonstrated warm start, built
    and trained first when missing (without ``train``: only where they will be; the
    demonstrations are played either way, to name the cache entry)."""
    environment = load_environment(config)
    if not demonstrates(type(environment)):
        raise refusal(config, type(environment))
    rows = demonstration_rows(environment, config)
    data = "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
    # what makes the model: the demonstrations, and the recipe's shape, template and SFT
    recipe = json.dumps([MODEL_SHAPE, EACH_TOOL, SFT_CONFIG.read_text()])
    digest = hashlib.sha256((recipe + data).encode()).hexdigest()[:16]
    name = f"{config.env}-{_version(config.env)}-{digest}"
    assets = ToolTaskAssets(cache_dir() / ASSETS_VERSION / name, config.env)

    def build(staging: Path) -> None:
        (staging / assets.sft_path.name).write_text(data)
        vocabulary = words(rows[0]["tools"], rows)
        template = chat_template(EACH_TOOL)
        build_tool_model(staging / "model", words=vocabulary, template=template, shape=MODEL_SHAPE)

    if train:
        build_once(assets.root, build)
    model = ensure_sft_model(assets, console, config=SFT_CONFIG, engine=engine, train=train)
    return assets, model
