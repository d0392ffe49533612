"""Rollout replicas as the controller sees them: in this process, or Ray actors reached
through the one remote-rollout proxy (:class:`~drivetrain.runtime.remote_rollout.RemoteRollout`
over a :class:`RayChannel`, so the weight-sync manager drives both alike), and a pool that
splits each step's prompts over the replicas."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from drivetrain.api import Completion, Prompt, Rollout, SamplingParams, registry
from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.runtime.remote_rollout import RolloutHost
from drivetrain.runtime.replicas import replica_slots
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


class RolloutPool:
    """Splits a step's prompts into contiguous chunks, one per replica, generated at once."""

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        if not rollouts:
            raise ValueError("a rollout pool needs at least one rollout")
        self.rollouts = list(rollouts)
        self._threads = ThreadPoolExecutor(len(self.rollouts), thread_name_prefix="rollout")

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        chunks: dict[int, list[Prompt]] = {}
        for slot, prompt in zip(
            replica_slots(len(prompts), len(self.rollouts)), prompts, strict=True
        ):
            chunks.setdefault(slot.first, []).append(prompt)
        jobs = [
            (first, self._threads.submit(self.rollouts[replica].generate, chunk, params))
            for replica, (first, chunk) in enumerate(chunks.items())
        ]
        out: list[Completion] = []
        for offset, job in jobs:
            out.extend(
                dataclasses.replace(c, prompt_index=c.prompt_index + offset) for c in job.result()
            )
        return out

    def shutdown(self) -> None:
        for rollout in self.rollouts:
            with contextlib.suppress(Exception):
                rollout.shutdown()
        self._threads.shutdown(wait=False)
