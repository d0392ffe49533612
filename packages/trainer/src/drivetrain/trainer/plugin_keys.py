"""Which other installed plugin an unknown config key belongs to: ``rollout.max_batch_size``
under ``--rollout vllm`` is an option of the hf rollout, and vllm's nearest knob is
``max_num_seqs``. Read from the plugins' config dataclasses (light modules: no torch)."""

from __future__ import annotations

import dataclasses
import difflib

from drivetrain.api import config as api_config
from drivetrain.api import registry
from drivetrain.api.errors import PluginError


def _family(owner: type) -> type | None:
    """The api's base config class ``owner`` extends (``RolloutConfig``, ``EngineConfig``...):
    plugins configured by the same base are alternatives to one another."""
    return next((c for c in owner.__mro__ if c.__module__ == api_config.__name__), None)


def _plugin_configs(family: type) -> tuple[str, list[tuple[str, type]]]:
    """The kind of plugin (``"rollout"``), and (name, config class) for each installed plugin
    configured by a subclass of ``family``; plugins whose config does not import are skipped
    (they are reported when chosen)."""
    kind, found = "plugin", []
    for reg in registry.REGISTRIES.values():
        for record in reg.inspect(load=False):
            if not (record.spec and record.spec.config):
                continue
            try:
                config = reg.load_config_class(record.name, family)
            except PluginError:
                continue
            if isinstance(config, type) and issubclass(config, family):
                kind = reg.kind
                found.append((record.name, config))
    return kind, found


def other_plugin_hint(owner: type, where: str, key: str) -> str:
    """A sentence when ``key`` (relative to the config level ``where``, whose dataclass is
    ``owner``) is an option of another installed plugin of the same kind; else ``""``."""
    family = _family(owner)
    if family is None or not dataclasses.is_dataclass(owner):
        return ""
    field = key.split(".")[0]
    mine = {f.name for f in dataclasses.fields(owner)}
    if field in mine:
        return ""
    kind, configs = _plugin_configs(family)
    chosen = [name for name, config in configs if config is owner]
    others = {n: {f.name for f in dataclasses.fields(c)} for n, c in configs if c is not owner}
    owners = [name for name, fields in others.items() if field in fields]
    if not owners:
        return ""
    dotted = f"{where}.{key}" if where else key
    plural = "s" if len(owners) > 1 else ""
    text = f"{dotted} is an option of the {' and '.join(owners)} {kind}{plural}"
    # the chosen plugin's counterpart: among its own knobs, the name closest to the key
    counterparts = sorted(mine.difference(*(others[name] for name in owners)))
    close = difflib.get_close_matches(field, counterparts, n=1, cutoff=0.5)
    if chosen and close:
        text += f"; the {'/'.join(chosen)} {kind} has {close[0]}"
    return text
