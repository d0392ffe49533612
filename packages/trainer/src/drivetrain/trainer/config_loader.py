"""Typed configs from YAML files and dotted overrides, via OmegaConf structured configs.

``load_config(EngineConfig, files=["run.yaml"], overrides=["optim.lr=1e-6"])`` returns a frozen
``EngineConfig``. Unknown keys, wrong types and invalid values raise :class:`ConfigError`
naming the key and, for unknown keys, the valid ones at that level.
"""

from __future__ import annotations

import dataclasses
import io
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.plugin_keys import other_plugin_hint
from drivetrain.trainer.utf8 import decode_utf8

T = TypeVar("T")

#: keys renamed so that one word means one thing ("workers": the actor's ranks): the old name
#: fails in one line naming the new one
RENAMED = {
    "placement.rollout_workers": "placement.rollout_replicas",
    "episode.workers": "episode.env_threads",
    # the algorithm's components, each with its config next to it (rl/dapo.py, rl/off_policy.py,
    # rl/group_stream.py, rl/policy_losses.py, rl/kl.py)
    **{
        f"algorithm.{k}": f"algorithm.dapo.{k}"
        for k in (
            "dynamic_sampling",
            "max_sampling_rounds",
            "overlong_buffer",
            "overlong_penalty",
            "overlong_filter",
        )
    },
    **{
        f"algorithm.{k}": f"algorithm.ahead.{k}"
        for k in (
            "max_staleness",
            "stale_samples",
            "sync_every",
            "partial_rollouts",
            "scripted_rounds",
        )
    },
    "algorithm.correction": "algorithm.correction.method",
    **{
        f"algorithm.{k}": f"algorithm.clip.{v}"
        for k, v in (
            ("clip_low", "low"),
            ("clip_high", "high"),
            ("dual_clip", "dual"),
        )
    },
    **{f"algorithm.kl_{k}": f"algorithm.kl.{k}" for k in ("coef", "in_reward", "estimator")},
    **{f"algorithm.correction_{k}": f"algorithm.correction.{k}" for k in ("cap", "low", "high")},
}


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    """The dotted keys of a loaded YAML layer's values (mappings walked, lists are values)."""
    if not isinstance(node, DictConfig):
        return [prefix]
    return [
        key
        for name, child in node.items_ex(resolve=False)
        for key in _leaf_keys(child, f"{prefix}.{name}" if prefix else str(name))
    ]


def _refuse_renamed(keys: Sequence[str], where: str) -> None:
    for key in keys:
        if key in RENAMED:
            raise ConfigError(f"config key '{key}' is now '{RENAMED[key]}'{where}")


def _owner(config_type: type, dotted: str) -> tuple[str, type]:
    """The dataclass level that ``dotted`` points into, and that level's dataclass."""
    owner, parts = config_type, dotted.split(".")
    prefix: list[str] = []
    for part in parts[:-1]:
        hints = typing.get_type_hints(owner)
        if part not in hints or not dataclasses.is_dataclass(hints[part]):
            break
        owner = hints[part]
        prefix.append(part)
    return ".".join(prefix), owner


def _explain(config_type: type, exc: OmegaConfBaseException) -> ConfigError:
    key = getattr(exc, "full_key", None) or ""
    if isinstance(exc, ConfigKeyError) and key:
        where, owner = _owner(config_type, key)
        level = f"'{where}'" if where else "the top level"
        valid = ", ".join(f.name for f in dataclasses.fields(owner))
        elsewhere = other_plugin_hint(owner, where, key.removeprefix(where).lstrip("."))
        cause = f"{elsewhere}" if elsewhere else f"unknown config key '{key}'"
        return ConfigError(f"{cause}; valid keys at {level}: {valid}")
    first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return ConfigError(f"invalid config value for '{key}': {first_line}" if key else first_line)


def _load_yaml(file: Path) -> DictConfig | ListConfig:
    """One YAML file; a syntax error names ``file:line:column`` instead of a traceback."""
    if file.is_dir():
        raise ConfigError(f"config file {str(file)!r} is a directory")
    if not file.is_file():
        raise ConfigError(f"config file {str(file)!r} does not exist")
    # decoded here, not by the YAML reader: its decode errors count bytes per read chunk
    text = decode_utf8(file.read_bytes(), file, ConfigError)
    try:
        return OmegaConf.load(io.StringIO(text))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else str(file)
        raise ConfigError(f"{where}: YAML syntax error: {exc.problem or exc.context}") from None
    except (yaml.YAMLError, OSError) as exc:  # OSError: a scalar at the top, not a mapping
        raise ConfigError(f"{file}: not a YAML mapping ({exc})") from None


#: a YAML file, or a tuple of ``key=value`` strings (a layer a command sets, e.g. its defaults)
ConfigLayer = str | Path | tuple[str, ...]


def load_config(
    config_type: type[T], *, files: Sequence[ConfigLayer] = (), overrides: Sequence[str] = ()
) -> T:
    """Merge defaults, then each layer of ``files`` in order (YAML files; a tuple of
    ``key=value`` strings is a layer too), then ``key=value`` overrides."""
    if not dataclasses.is_dataclass(config_type):
        raise TypeError(f"{config_type!r} is not a dataclass")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"overrides must look like key=value, got {bad}")
    _refuse_renamed([o.split("=", 1)[0].strip() for o in overrides], "")
    try:
        merged: Any = OmegaConf.structured(config_type)
        for path in files:
            if isinstance(path, tuple):
                _refuse_renamed([o.split("=", 1)[0].strip() for o in path], "")
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(path)))
                continue
            loaded = _load_yaml(Path(path))
            _refuse_renamed(_leaf_keys(loaded), f" (in {path})")
            if not isinstance(loaded, type(merged)):
                raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top")
            merged = OmegaConf.merge(merged, loaded)
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        try:
            return typing.cast(T, OmegaConf.to_object(merged))
        except ConfigError as exc:
            raise _with_full_keys(merged, exc) from None
    except OmegaConfBaseException as exc:
        raise _explain(config_type, exc) from None


def peek(files: Sequence[ConfigLayer], overrides: Sequence[str], key: str) -> Any:
    """The value the layers give the dotted ``key`` before any typed config exists (``None``
    if none does): what picks the config type itself, e.g. ``rollout.python`` (a rollout's
    config then comes from that environment). Lists come back as lists. A layer that does not
    load raises as :func:`load_config` would; one that does not merge is left to it."""
    try:
        merged: Any = OmegaConf.create()
        for path in files:
            if isinstance(path, tuple):
                merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(path)))
            else:
                merged = OmegaConf.merge(merged, _load_yaml(Path(path)))
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([o for o in overrides if "=" in o]))
        value = OmegaConf.select(merged, key, default=None, throw_on_missing=False)
        return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
    except OmegaConfBaseException:
        return None


def _raising_section(node: DictConfig, message: str, path: str = "") -> tuple[str, DictConfig]:
    """The dotted path and node of the deepest dataclass section under ``node`` whose
    construction raises ``message`` (its ``__post_init__`` did); walked only on an error, so
    rebuilding the subtrees costs nothing a run pays."""
    for name, child in node.items_ex(resolve=False):
        if not isinstance(child, DictConfig) or not dataclasses.is_dataclass(
            OmegaConf.get_type(child)
        ):
            continue
        try:
            OmegaConf.to_object(child)
        except ConfigError as exc:
            if str(exc) == message:
                return _raising_section(child, message, f"{path}.{name}" if path else str(name))
        except OmegaConfBaseException:
            continue
    return path, node


#: a key not already under a prefix (no word character or '.' before it), then '=', ':' or
#: '.' and a key
_KEY = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(?==|:|\.\w)")


def _with_full_keys(merged: DictConfig, exc: ConfigError) -> ConfigError:
    """``exc`` from a nested section's ``__post_init__`` with its keys made full: a section
    names its keys from where it sits (``optim.lr``, ``strategy=``) and cannot know that it is
    ``actor.optim`` or ``engine``; the loader knows the path, so one place fixes every
    message (a key already full is left as it is)."""
    message = str(exc)
    path, section = _raising_section(merged, message)
    if not path:  # the top level: its messages name full keys already
        return exc
    name = path.rsplit(".", 1)[-1]
    owner = OmegaConf.get_type(section)
    fields = (
        {f.name for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    )

    def full(match: re.Match[str]) -> str:
        word, after = match.group(1), message[match.end()]
        if word == name:  # the section's own name: ``optim.lr=``, ``micro_batch:``
            return path
        if word in fields and after != ":":  # a field: ``strategy=``, ``model.lora.enabled``
            return f"{path}.{word}"
        return word

    rewritten = _KEY.sub(full, message)
    if not re.search(rf"(?<![\w.]){re.escape(path)}\b", rewritten):
        rewritten = f"{path}: {rewritten}"  # it names no key of its section: say where it is
    return ConfigError(rewritten)


def to_yaml(config: Any) -> str:
    """The config as YAML, the form ``--print-config`` shows and files accept."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))
