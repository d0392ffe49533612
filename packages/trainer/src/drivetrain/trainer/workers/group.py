"""A worker group: the controller's handle on every rank of one engine.

Two kinds exist. :class:`LocalWorkerGroup` holds this process's rank: the whole job when run
in-process, or one rank of an SPMD job under torchrun (every process runs the same controller
code on the same data and keeps its own data-parallel shard). ``RayWorkerGroup`` holds N Ray
actors driven from one controller. Both expose the same two calls:

- ``run_all(method, *args)``: the same call on every rank;
- ``run_sharded(method, batch, *args)``: each rank gets its data-parallel shard of ``batch``
  (ranks that share a ``dp_rank`` — tensor/pipeline peers — get the same shard).

Worker methods return the same value on every rank (they reduce what they need), so the
controller reads one result and parallel layouts with non-output ranks work unchanged. The one
exception is ``gather_sharded``: per-sample outputs (log-probs, values) come back from one
output rank per data-parallel shard, for the controller to put back in order.

A group is built from a *worker factory*: a picklable zero-argument callable that creates the
rank's worker (an :class:`EngineWorker` for SFT, an RL worker holding several roles' engines)
once the rank's environment is set. A worker has ``initialize() -> ParallelInfo``,
``shard(batch)``, ``close()`` and the methods the controller calls by name.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from typing import Any

from drivetrain.api import Batch, ParallelInfo

WorkerFactory = Callable[[], Any]


class WorkerGroup(abc.ABC):
    #: Whether this process writes logs, metrics and trainer files (one process per job does).
    is_writer: bool = True

    @property
    @abc.abstractmethod
    def parallel(self) -> ParallelInfo:
        """The layout of rank 0 (world size, data-parallel size)."""

    @abc.abstractmethod
    def run_all(self, method: str, *args: Any) -> Any: ...

    @abc.abstractmethod
    def run_sharded(self, method: str, batch: Batch, *args: Any) -> Any: ...

    @abc.abstractmethod
    def gather_sharded(self, method: str, batch: Batch, *args: Any) -> list[Any]:
        """``method`` on each rank's data-parallel shard; the results of one output rank per
        shard, in ``Batch.dp_shards`` order."""

    @abc.abstractmethod
    def close(self) -> None: ...


class LocalWorkerGroup(WorkerGroup):
    """This process's rank (in-process: the only one; under torchrun: one of many)."""

    def __init__(self, factory: WorkerFactory) -> None:
        self.worker = factory()
        self._parallel = self.worker.initialize()
        self.is_writer = self._parallel.rank == 0

    @property
    def parallel(self) -> ParallelInfo:
        return self._parallel

    def run_all(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def run_sharded(self, method: str, batch: Batch, *args: Any) -> Any:
        return getattr(self.worker, method)(self.worker.shard(batch), *args)

    def gather_sharded(self, method: str, batch: Batch, *args: Any) -> list[Any]:
        if self._parallel.dp_size != 1:  # torchrun SPMD: every rank holds only its own shard
            raise NotImplementedError("gather_sharded needs the whole group (Ray or in-process)")
        return [self.run_sharded(method, batch, *args)]

    def close(self) -> None:
        self.worker.close()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
