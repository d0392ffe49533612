"""A rollout replica in a Ray actor, as the controller sees it: reached through the one
remote-rollout proxy (:class:`~drivetrain.runtime.remote_rollout.RemoteRollout` over a
:class:`RayChannel`), so the placement's rollout service and weight-sync manager drive it as
they drive a rollout in this process.

A call that has not answered within the rollout's ``stall_timeout_s`` is followed by a ping in
the actor's own ``ping`` concurrency group (it answers while a long call runs). An actor that
answers no ping either is alive but stopped: it is killed and the run fails in one line
(:class:`~drivetrain.api.errors.RolloutStalled`). Unlike a server process's quick calls, a
call here is not bounded by the deadline alone: it may wait in the actor's queue behind a long
one (a weight sync's receive), so an actor hung inside a call but answering pings is bounded
by the call's timeout only."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.errors import RolloutStalled
from drivetrain.runtime.remote_rollout import RolloutHost
from drivetrain.trainer.errors import WorkerError
from drivetrain.trainer.rl.hosted import rollout_factory
from drivetrain.trainer.workers.ray_runtime import wait_all

#: the actor's options that give :meth:`RolloutActor.ping` its own thread
ACTOR_OPTIONS = {"concurrency_groups": {"ping": 1}}


class RolloutActor:
    """Ray actor body: hosts one rollout backend, built through the registry in the actor (or
    the proxy to it in the server process of ``rollout.python``)."""

    def __init__(self, name: str, config: RolloutConfig, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.host = RolloutHost(rollout_factory(name, config)(config))

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> Any:
        from drivetrain.trainer.workers.ray_group import this_node

        return this_node()

    def ping(self) -> int:
        """Runs in the ``ping`` concurrency group, beside a long ``call``."""
        return os.getpid()

    def call(self, method: str, *args: Any) -> Any:
        return self.host.call(method, *args)


class RayChannel:
    """The remote-rollout channel to a :class:`RolloutActor`; every call waits with the
    actor's failure surfacing as a :class:`~drivetrain.trainer.errors.WorkerError`."""

    def __init__(
        self, actor: Any, timeout_s: float | None, *, stall_timeout_s: float, name: str
    ) -> None:
        self.actor = actor
        self.timeout_s = timeout_s
        self.stall_timeout_s, self.name = stall_timeout_s, name
        self._stalled: RolloutStalled | None = None  # once stalled, every call fails at once

    def call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        import ray

        if self._stalled is not None:
            raise self._stalled
        timeout = None if self.timeout_s is None else self.timeout_s + wait_s
        began, ref = time.monotonic(), self.actor.call.remote(method, *args)
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - began)
            if left is not None and left <= 0:
                raise WorkerError(f"Ray workers timed out after {timeout}s rollout {method}")
            slice_s = self.stall_timeout_s if left is None else min(left, self.stall_timeout_s)
            if ray.wait([ref], timeout=slice_s)[0]:
                return wait_all(ref, None, f"rollout {method}")
            if not self._answers_ping():
                waited_s = time.monotonic() - began
                raise self._stall(
                    f"did not answer {method} for {waited_s:.0f} s nor a ping for "
                    f"{self.stall_timeout_s:g} s"
                )

    def _answers_ping(self) -> bool:
        """The call is slow: does the actor still answer a ping within the deadline?"""
        import ray

        ping = self.actor.ping.options(concurrency_group="ping").remote()
        return bool(ray.wait([ping], timeout=self.stall_timeout_s)[0])

    def _stall(self, what: str) -> RolloutStalled:
        """The actor is alive but silent: kill it (what it holds goes now, not at Ray's
        exit), and every later call fails at once with the same line."""
        import ray

        self._stalled = RolloutStalled(
            f"the rollout actor {self.name} {what} (rollout.stall_timeout_s): it is alive but "
            "stopped or hung; it was killed"
        )
        ray.kill(self.actor, no_restart=True)
        return self._stalled

    def send_weights_inline(self, weights: Iterable[NamedTensor], version: int) -> None:
        raise NotImplementedError("a Ray rollout receives weights through a transport")

    def close(self) -> None:
        return None  # the placement kills the actor
