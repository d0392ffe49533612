"""``python -m drivetrain.runtime.describe rollout NAME``: what this environment's registry
knows of the rollout NAME, as one JSON line on stdout, so that a trainer in another environment
can configure and start it without having it installed (``rollout.python``; the trainer's side
is :mod:`drivetrain.runtime.hosted_rollout`). Standard library only, and it imports the
plugin's light modules alone (its spec and config class), so it answers in a fraction of a
second before anything heavy starts.

The line holds ``name``, ``distribution``, ``version``, ``api``, ``factory``, ``capabilities``,
``install_hint``, ``description``, ``config`` (the class, ``module:attribute``) and ``fields``
(each ``{"name", "type", "default"}``; ``type`` is ``str``/``int``/``float``/``bool`` or
``tuple[<one of those>]``, any other type is named and marked ``"supported": false``, a field
without a default ``"required": true``), and ``transports``: each weight-sync transport this
environment could receive weights over, with ``""`` or the registry's one-line reason it
cannot. A rollout the registry cannot give is ``{"error": <its one line>, "installed":
<whether the name is installed here>, "names": <the rollouts that are>}`` and exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from typing import Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.errors import PluginError
from drivetrain.api.first_party import INSTALL_HINTS
from drivetrain.api.registry import Registry, ckpt_engines, rollouts

_SCALARS = (str, int, float, bool)


def _type_name(hint: Any) -> tuple[str, bool]:
    """The field type as the trainer's side reads it, and whether it can build it."""
    if hint in _SCALARS:
        return hint.__name__, True
    args = typing.get_args(hint)
    tuple_of = typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis
    if tuple_of and args[0] in _SCALARS:
        return f"tuple[{args[0].__name__}]", True
    return getattr(hint, "__name__", None) or str(hint), False


def _field(field: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    name, supported = _type_name(hint)
    entry: dict[str, Any] = {"name": field.name, "type": name}
    if not supported:
        entry["supported"] = False
    if field.default is not dataclasses.MISSING:
        default = field.default
    elif field.default_factory is not dataclasses.MISSING:
        default = field.default_factory()
    else:
        return {**entry, "required": True}
    entry["default"] = list(default) if isinstance(default, tuple) else default
    return entry


def _problem(registry: Registry, name: str) -> str:
    try:
        registry.spec(name)
    except PluginError as exc:
        return str(exc)
    return ""


def describe_rollout(name: str) -> dict[str, Any]:
    """The description of the rollout ``name`` (see the module's docstring)."""
    try:
        spec = rollouts.spec(name)
        config = rollouts.load_config_class(name, RolloutConfig)
    except PluginError as exc:
        names = rollouts.names()
        return {"error": str(exc), "installed": name in names, "names": names}
    if not dataclasses.is_dataclass(config):
        return {"error": f"rollout {name!r}: config {spec.config} is not a dataclass"}
    hints = typing.get_type_hints(config)
    record = next(r for r in rollouts.inspect(load=False) if r.name == name)
    known = set(ckpt_engines.names()) | set(INSTALL_HINTS["drivetrain.ckpt_engines"])
    return {
        "name": spec.name,
        "distribution": record.distribution,
        "version": record.version,
        "api": spec.api,
        "factory": spec.factory,
        "capabilities": sorted(spec.capabilities),
        "install_hint": spec.install_hint,
        "description": spec.description,
        "config": spec.config or f"{RolloutConfig.__module__}:{RolloutConfig.__qualname__}",
        "fields": [_field(f, hints[f.name]) for f in dataclasses.fields(config) if f.init],
        "transports": {t: _problem(ckpt_engines, t) for t in sorted(known)},
    }


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] != "rollout":
        print(json.dumps({"error": "usage: python -m drivetrain.runtime.describe rollout NAME"}))
        return 2
    answer = describe_rollout(args[1])
    print(json.dumps(answer, default=repr))  # a default JSON cannot hold: named, not built
    return 2 if "error" in answer else 0


if __name__ == "__main__":
    sys.exit(main())
