"""A worker group: the controller's handle on every rank of one engine.

Two kinds exist. :class:`LocalWorkerGroup` holds this process's rank: the whole job when run
in-process, or one rank of an SPMD job under torchrun (every process runs the same controller
code on the same data and keeps its own data-parallel shard). ``RayWorkerGroup`` holds N Ray
actors driven from one controller. Both expose the same two calls:

- ``run_all(Worker.method, *args)``: the same call on every rank;
- ``run_sharded(Worker.method, batch, *args)``: each rank gets its data-parallel shard of
  ``batch`` (ranks that share a ``dp_rank`` — tensor/pipeline peers — get the same shard).

``method`` is the worker class's function (``RoleWorker.train``), never its name as a string: a
typo fails where the controller names it, before any Ray actor runs, and a type checker checks
the arguments against the method's signature. Ranks call it by name on their own worker, so a
subclass's override runs (``PreferenceWorker`` is an ``RoleWorker``).

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
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from drivetrain.api import Batch, ParallelInfo

WorkerFactory = Callable[[], Any]
P = ParamSpec("P")
R = TypeVar("R")


class SavesState(Protocol):
    """What every worker offers for a job's checkpoints and export (an ``EngineWorker``, a
    ``RoleWorker``: each rank saves, loads and exports what it trains)."""

    def save_checkpoint(self, path: str, step: int) -> None: ...

    def load_checkpoint(self, path: str) -> int: ...

    def export_hf(self, path: str) -> None: ...


#: A worker method as the controller names it: ``RoleWorker.save_checkpoint``.
WorkerCall = Callable[Concatenate[Any, P], R]
#: A worker method taking the rank's data-parallel shard first: ``RoleWorker.train``.
ShardCall = Callable[Concatenate[Any, Batch, P], R]


def _positional_only(kwargs: dict[str, Any]) -> None:
    if kwargs:  # Ray's remote call and the name dispatch pass positional arguments only
        raise TypeError(f"worker calls take positional arguments, not {sorted(kwargs)}")


def method_name(method: Callable[..., Any]) -> str:
    """The name a rank calls ``method`` by; refuses anything but a class's function."""
    if isinstance(method, str) or not callable(method):
        raise TypeError(
            f"worker calls take the worker class's method (e.g. RoleWorker.train), not {method!r}"
        )
    qualified = getattr(method, "__qualname__", "")
    if "." not in qualified or "<locals>" in qualified.rpartition(".")[0].rpartition(".")[2]:
        raise TypeError(f"{qualified or method!r} is not a method of a worker class")
    return method.__name__


class WorkerGroup(abc.ABC):
    #: Whether this process writes logs, metrics and trainer files (one process per job does).
    is_writer: bool = True

    @property
    @abc.abstractmethod
    def parallel(self) -> ParallelInfo:
        """The layout of rank 0 (world size, data-parallel size)."""

    def where(self) -> str:
        """One line saying which machines the ranks run on, where that is worth saying (Ray:
        the nodes of a cluster); empty otherwise."""
        return ""

    def run_all(self, method: WorkerCall[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``method`` on every rank; rank 0's result (every rank returns the same)."""
        _positional_only(kwargs)
        return self._run_all(method_name(method), args)

    def run_sharded(
        self, method: ShardCall[P, R], batch: Batch, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method`` on each rank's data-parallel shard of ``batch``; rank 0's result."""
        _positional_only(kwargs)
        return self._run_sharded(method_name(method), batch, args)

    def gather_sharded(
        self, method: ShardCall[P, R], batch: Batch, *args: P.args, **kwargs: P.kwargs
    ) -> list[R]:
        """``method`` on each rank's data-parallel shard; the results of one output rank per
        shard, in ``Batch.dp_shards`` order."""
        _positional_only(kwargs)
        return self._gather_sharded(method_name(method), batch, args)

    @abc.abstractmethod
    def _run_all(self, name: str, args: tuple[Any, ...]) -> Any: ...

    @abc.abstractmethod
    def _run_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> Any: ...

    @abc.abstractmethod
    def _gather_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> list[Any]: ...

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

    def _run_all(self, name: str, args: tuple[Any, ...]) -> Any:
        return getattr(self.worker, name)(*args)

    def _run_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> Any:
        return getattr(self.worker, name)(self.worker.shard(batch), *args)

    def _gather_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> list[Any]:
        if self._parallel.dp_size != 1:  # torchrun SPMD: every rank holds only its own shard
            raise NotImplementedError("gather_sharded needs the whole group (Ray or in-process)")
        return [self._run_sharded(name, batch, args)]

    def close(self) -> None:
        self.worker.close()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ
    )
