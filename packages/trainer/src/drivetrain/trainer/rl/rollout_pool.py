"""Rollout replicas as the controller sees them: in this process, or Ray actors behind a
:class:`~drivetrain.api.rollout.Rollout` proxy (so the weight-sync manager drives both alike),
and a pool that splits each step's prompts over the replicas."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from drivetrain.api import Completion, Prompt, Rollout, SamplingParams, registry
from drivetrain.api.config import RolloutConfig, WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.partition import chunk_sizes
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.trainer.workers.ray_runtime import wait_all


class RolloutActor:
    """Ray actor body: one rollout backend, built through the registry in the actor."""

    def __init__(self, name: str, config: RolloutConfig, env: Mapping[str, str]) -> None:
        os.environ.update(env)
        self.rollout = registry.rollouts.load(name)(config)

    def pid(self) -> int:
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.rollout, method)(*args, **kwargs)

    def version(self) -> int:
        return self.rollout.weight_version


class RayRolloutHandle(Rollout):
    """A rollout living in a Ray actor; every call waits with the actor's failure surfacing
    as a :class:`~drivetrain.trainer.errors.WorkerError`."""

    def __init__(self, actor: Any, config: RolloutConfig, timeout_s: float | None) -> None:
        super().__init__(config)
        self.actor = actor
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        ref = self.actor.call.remote(method, *args, **kwargs)
        return wait_all(ref, self.timeout_s, f"rollout {method}")

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self._call("generate", list(prompts), params)

    def submit(self, requests: Sequence[Request]) -> None:
        self._call("submit", list(requests))

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        return self._call("poll", timeout_s)

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        return self._call("abort", None if request_ids is None else list(request_ids))

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        raise NotImplementedError(
            "a Ray rollout receives weights through a transport (connect_weight_sync)"
        )

    @property
    def weight_version(self) -> int:
        return wait_all(self.actor.version.remote(), self.timeout_s, "rollout weight_version")

    def sleep(self, level: int = 1) -> bool:
        return self._call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", tags)

    def pause_generation(self, *, abort: bool = False) -> int:
        return self._call("pause_generation", abort=abort)

    def resume_generation(self) -> None:
        self._call("resume_generation")

    def connect_weight_sync(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None:
        self._call(
            "connect_weight_sync", transport, config, rank=rank, topology=topology,
            endpoint=endpoint,
        )  # fmt: skip

    def receive_weights(self, version: int) -> SyncStats:
        return self._call("receive_weights", version)

    def disconnect_weight_sync(self) -> None:
        self._call("disconnect_weight_sync")

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._call("shutdown")


class RolloutPool:
    """Splits a step's prompts into contiguous chunks, one per replica, generated at once."""

    def __init__(self, rollouts: Sequence[Rollout]) -> None:
        if not rollouts:
            raise ValueError("a rollout pool needs at least one rollout")
        self.rollouts = list(rollouts)
        self._threads = ThreadPoolExecutor(len(self.rollouts), thread_name_prefix="rollout")

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        sizes = chunk_sizes(len(prompts), min(len(self.rollouts), len(prompts)))
        jobs, start = [], 0
        for rollout, size in zip(self.rollouts, sizes, strict=False):
            chunk = list(prompts[start : start + size])
            jobs.append((start, self._threads.submit(rollout.generate, chunk, params)))
            start += size
        out: list[Completion] = []
        for offset, job in jobs:
            out.extend(
                dataclasses.replace(c, prompt_index=c.prompt_index + offset) for c in job.result()
            )
        return out

    def each(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        jobs = [self._threads.submit(getattr(r, method), *args, **kwargs) for r in self.rollouts]
        return [job.result() for job in jobs]

    def shutdown(self) -> None:
        for rollout in self.rollouts:
            with contextlib.suppress(Exception):
                rollout.shutdown()
        self._threads.shutdown(wait=False)
