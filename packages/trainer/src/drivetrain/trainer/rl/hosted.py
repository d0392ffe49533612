"""A rollout hosted in the Python environment of ``rollout.python``
(:mod:`drivetrain.runtime.hosted_rollout`).

When the job's layers set ``rollout.python``, the rollout is described by that environment
(:func:`~drivetrain.runtime.hosted_rollout.describe_in`: its spec, config fields and the
transports it can receive over), configured by what it says, and started there by the rollout
host; it is never loaded here, so it need not be installed here. Whatever it is, it runs
there: a rollout installed here too never falls back to this process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from drivetrain.api import registry
from drivetrain.api.config import RolloutConfig
from drivetrain.api.errors import PluginError
from drivetrain.runtime.hosted_rollout import HostedRollout, describe_in, rollout_host
from drivetrain.trainer.capabilities import require
from drivetrain.trainer.config_loader import ConfigLayer, peek


def find_hosted(
    rollout: str, files: Sequence[ConfigLayer], overrides: Sequence[str]
) -> HostedRollout | None:
    """The rollout as ``rollout.python``'s environment has it, if the layers set that key;
    refused in one line when it is not installed there or cannot run in a process of its own."""
    python = peek(files, overrides, "rollout.python")
    if not python:
        return None
    env = peek(files, overrides, "rollout.env") or ()
    hosted = describe_in(str(python), rollout, env=[str(item) for item in env])
    # before its config type is built: a rollout that cannot be hosted is refused for that
    require("rollout", hosted.spec, "separate_process", hosted.where)
    return hosted


def check_transport(hosted: HostedRollout, transport: str) -> None:
    """Refuse a transport the rollout's environment cannot receive over, in its own words,
    before anything starts (else the weight connect fails once the rollout is up)."""
    problem = hosted.transport_problem(transport)
    if problem:
        raise PluginError(
            f"{hosted.where}: the rollout's environment cannot receive the weights over "
            f"{transport}: {problem}"
        )


def rollout_factory(name: str, config: RolloutConfig) -> Callable[[RolloutConfig], Any]:
    """What makes the rollout ``name`` from ``config``: the rollout host where
    ``config.python`` is set (the rollout runs in that environment), else the registry's
    class, in this process."""
    if getattr(config, "python", ""):
        return functools.partial(rollout_host(), name)
    return registry.rollouts.load(name)
