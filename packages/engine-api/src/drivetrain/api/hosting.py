"""Where a rollout runs: in this process, or in a server process of another Python environment
(``rollout.python``), which the trainer's environment reaches without having the rollout
installed. The machinery is drivetrain-runtime's (:mod:`drivetrain.runtime.hosted_rollout`: the
description of a rollout by that environment, the config type built from it, and the rollout
host, the entry point ``process`` of the group ``drivetrain.rollout_hosts``)."""

from __future__ import annotations

from dataclasses import dataclass

from drivetrain.api.config import RolloutConfig
from drivetrain.api.errors import ConfigError

#: the knobs of :class:`HostingConfig`: how to start the host, not the rollout's own
HOSTING_FIELDS = ("python", "start_timeout_s", "request_timeout_s", "env")


@dataclass(frozen=True)
class HostingConfig(RolloutConfig):
    """Where a rollout runs. ``python`` names the interpreter of another Python environment (one
    made by ``python -m drivetrain.rollout.env``): the rollout then runs there in a server
    process and only plain data and weight bytes cross over, so that environment may pin its
    own torch and transformers, and the rollout need not be installed in the trainer's. Empty:
    the rollout runs in this process. ``start_timeout_s`` bounds the start (the model load
    included), ``request_timeout_s`` any one call; ``env`` adds ``NAME=value`` variables to
    the server process's environment (and to the one that describes the rollout)."""

    python: str = ""
    start_timeout_s: float = 600.0
    request_timeout_s: float = 3600.0  # a server process that answers no request this long fails
    env: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.start_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ConfigError("rollout.start_timeout_s and request_timeout_s must be > 0")
        bad = [item for item in self.env if "=" not in item or item.startswith("=")]
        if bad:
            raise ConfigError(f"rollout.env entries must be NAME=value, got {bad}")
