"""Planning in a child process, for a process that holds a process group of its own: the
config, world size and work go to ``python -m drivetrain.engine.fsdp.plan_child`` as JSON on
its stdin, the plan comes back as JSON on its stdout (no pickles cross)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from typing import Any

from drivetrain.api.errors import ConfigError
from drivetrain.api.plan import MemoryPlan, RankWork
from drivetrain.engine.fsdp.config import FSDPConfig


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


def plan_in_child(config: FSDPConfig, world: int, work: RankWork) -> MemoryPlan:
    """``plan_here`` in a fresh interpreter; its error in one line if it fails."""
    request = {
        "config": dataclasses.asdict(config),
        "world": world,
        "work": dataclasses.asdict(work),
    }
    done = subprocess.run(
        [sys.executable, "-m", "drivetrain.engine.fsdp.plan_child"],
        input=json.dumps(request), capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["(no output)"]
        raise ConfigError(f"planning failed in its child process: {lines[-1]}")
    return MemoryPlan(**json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    from drivetrain.engine.fsdp.plan import plan_here

    request = json.loads(sys.stdin.read())
    config = from_dict(FSDPConfig, request["config"])
    plan = plan_here(config, int(request["world"]), from_dict(RankWork, request["work"]))
    print(json.dumps(dataclasses.asdict(plan)), flush=True)


if __name__ == "__main__":
    main()
