"""A rollout replica in a Ray actor, as the controller sees it: reached through the one
remote-rollout proxy (:class:`~drivetrain.runtime.remote_rollout.RemoteRollout` over a
:class:`RayChannel`), so the placement's rollout service and weight-sync manager drive it as
they drive a rollout in this process."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from drivetrain.api import registry
from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.runtime.remote_rollout import RolloutHost
from drivetrain.trainer.workers.ray_runtime import wait_all


class RolloutActor:
    """Ray actor body: hosts one rollout backend, built through the registry in the actor."""

    def __init__(self, name: str, config: RolloutConfig, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.host = RolloutHost(registry.rollouts.load(name)(config))

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return self.host.call(method, *args)


class RayChannel:
    """The remote-rollout channel to a :class:`RolloutActor`; every call waits with the
    actor's failure surfacing as a :class:`~drivetrain.trainer.errors.WorkerError`."""

    def __init__(self, actor: Any, timeout_s: float | None) -> None:
        self.actor = actor
        self.timeout_s = timeout_s

    def call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        timeout = None if self.timeout_s is None else self.timeout_s + wait_s
        return wait_all(self.actor.call.remote(method, *args), timeout, f"rollout {method}")

    def send_weights_inline(self, weights: Iterable[NamedTensor], version: int) -> None:
        raise NotImplementedError("a Ray rollout receives weights through a transport")

    def close(self) -> None:
        return None  # the placement kills the actor
