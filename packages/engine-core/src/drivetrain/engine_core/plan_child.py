"""Planning in a child process: the fake process group a planner builds must be the default
group, and the planner's patches and parallel state are the process's. The planner (a
``module:function`` taking ``(config, world, work)``), the config's class, the config, world
size and work go to ``python -m drivetrain.engine_core.plan_child`` as JSON on its stdin; the
plan comes back as JSON on its stdout (no pickles cross). A child only imports what the
request names inside ``drivetrain.engine`` (an engine's own planner and config class)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
import typing
from typing import Any

from drivetrain.api.errors import ConfigError
from drivetrain.api.plan import MemoryPlan, RankWork


def from_dict(kind: Any, data: Any) -> Any:
    """``data`` (``dataclasses.asdict``'s JSON) as the dataclass ``kind`` again."""
    if not dataclasses.is_dataclass(kind):
        return tuple(data) if isinstance(data, list) else data
    hints = typing.get_type_hints(kind)
    values = {
        f.name: from_dict(hints[f.name] if isinstance(hints[f.name], type) else None, data[f.name])
        for f in dataclasses.fields(kind)
        if f.name in data and f.init
    }
    return kind(**values)


def plan_in_child(planner: str, config: Any, world: int, work: RankWork) -> MemoryPlan:
    """``planner`` (``module:function`` in ``drivetrain.engine``) in a fresh interpreter; its
    error in one line if it fails."""
    kind = type(config)
    request = {
        "planner": planner,
        "config_class": f"{kind.__module__}:{kind.__qualname__}",
        "config": dataclasses.asdict(config),
        "world": world,
        "work": dataclasses.asdict(work),
    }
    done = subprocess.run(
        [sys.executable, "-m", "drivetrain.engine_core.plan_child"],
        input=json.dumps(request), capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise ConfigError(f"planning failed in its child process: {lines[-1]}")
    return MemoryPlan(**json.loads(done.stdout.strip().splitlines()[-1]))


def _named(target: str) -> Any:
    module, _, name = target.partition(":")
    if not module.startswith("drivetrain.engine."):
        raise ConfigError(f"a plan's child imports engines' code only, not {target!r}")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    request = json.loads(sys.stdin.read())
    planner = _named(request["planner"])
    config = from_dict(_named(request["config_class"]), request["config"])
    plan = planner(config, int(request["world"]), from_dict(RankWork, request["work"]))
    print(json.dumps(dataclasses.asdict(plan)), flush=True)


if __name__ == "__main__":
    main()
