"""Ray worker group: N actors, one engine rank each, forming one torch.distributed group.

Actors are placed with a placement group (one bundle per rank, packed onto as few nodes as
possible), so the same code runs on a laptop (``ray.init()`` started here) and on a multi-node
cluster joined by address (``workers.ray_address=auto`` or ``host:port``). Rank 0's actor picks
the rendezvous address and port on its own node; every actor exports torchrun's variables
before building its engine, so engines need nothing Ray-specific.
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any

from drivetrain.api import Batch, EngineConfig, ParallelInfo
from drivetrain.api.partition import dp_shard_indices
from drivetrain.trainer.errors import WorkerError
from drivetrain.trainer.sft_config import WorkersConfig
from drivetrain.trainer.workers.engine_worker import EngineWorker
from drivetrain.trainer.workers.group import WorkerGroup

#: Driver environment variables every actor inherits (Ray does not forward the environment).
FORWARDED_ENV_PREFIXES = ("DRIVETRAIN_", "HF_", "TRANSFORMERS_", "TORCH_", "NCCL_", "GLOO_")
FORWARDED_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "CUDA_DEVICE_ORDER")


def rendezvous_address() -> tuple[str, int]:
    """This node's IP (as Ray sees it) and a free TCP port on it."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class RankActor:
    """The actor body: an :class:`EngineWorker` created once torchrun's variables are set."""

    def __init__(self) -> None:
        self.worker: EngineWorker | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, engine_name: str, config: EngineConfig, env: dict[str, str]) -> ParallelInfo:
        import torch

        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        self.worker = EngineWorker(engine_name, config, env)
        return self.worker.initialize()

    def call(self, method: str, *args: Any) -> Any:
        assert self.worker is not None, "setup() first"
        return getattr(self.worker, method)(*args)


def _driver_env() -> dict[str, str]:
    return {
        key: value
        for key, value in os.environ.items()
        if key in FORWARDED_ENV or key.startswith(FORWARDED_ENV_PREFIXES)
    }


class RayWorkerGroup(WorkerGroup):
    def __init__(self, engine_name: str, config: EngineConfig, workers: WorkersConfig) -> None:
        # Under `uv run`, Ray would otherwise ship the current directory to every worker and
        # re-create the environment there with uv; our workers run in the driver's (or the
        # cluster's) already-synced environment. Read when ray is first imported.
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_pg = remove_placement_group
        self._started_ray = False
        self._actors: list[Any] = []
        self._pg = None
        self.is_writer = True
        if not ray.is_initialized():
            init: dict[str, Any] = {
                "log_to_driver": True,
                "runtime_env": {"env_vars": _driver_env()},
            }
            if workers.ray_address:
                init["address"] = workers.ray_address
            else:
                # "local": never join a cluster found through RAY_ADDRESS or a stale session.
                init.update(
                    address="local",
                    num_cpus=max(os.cpu_count() or 1, workers.num),
                    include_dashboard=False,
                )
            ray.init(**init)
            self._started_ray = True
        try:
            gpus = workers.gpus_per_worker
            if gpus < 0:
                gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= workers.num else 0.0
            bundle: dict[str, float] = {"CPU": workers.cpus_per_worker}
            if gpus > 0:
                bundle["GPU"] = gpus
            self._pg = placement_group([dict(bundle) for _ in range(workers.num)], strategy="PACK")
            self._wait(self._pg.ready(), workers.start_timeout_s, "placing the workers")
            actor_class = ray.remote(RankActor)
            self._actors = [
                actor_class.options(
                    num_cpus=workers.cpus_per_worker,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank
                    ),
                ).remote()
                for rank in range(workers.num)
            ]
            ips = self._wait(
                [a.node_ip.remote() for a in self._actors], workers.start_timeout_s, "starting"
            )
            addr, port = self._wait(self._actors[0].rendezvous.remote(), 60, "rendezvous")
            setups = [
                actor.setup.remote(
                    engine_name, config, self._rank_env(rank, ips, addr, port, gpus > 0)
                )
                for rank, actor in enumerate(self._actors)
            ]
            self._infos: list[ParallelInfo] = self._wait(
                setups, workers.start_timeout_s, "initializing the engines"
            )
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _rank_env(rank: int, ips: list[str], addr: str, port: int, gpu: bool) -> dict[str, str]:
        same_node = [r for r, ip in enumerate(ips) if ip == ips[rank]]
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(ips)),
            # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is always 0.
            "LOCAL_RANK": "0" if gpu else str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }

    def _wait(self, refs: Any, timeout: float | None, what: str) -> Any:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"Ray workers timed out after {timeout}s {what}") from None
        except ray.exceptions.RayActorError as exc:
            raise WorkerError(f"a Ray worker died while {what}: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.as_instanceof_cause()
            if isinstance(cause, Exception) and not isinstance(cause, ray.exceptions.RayError):
                raise cause from None
            raise WorkerError(f"a Ray worker failed while {what}: {exc}") from None

    @property
    def parallel(self) -> ParallelInfo:
        return self._infos[0]

    def run_all(self, method: str, *args: Any) -> Any:
        refs = [a.call.remote(method, *args) for a in self._actors]
        return self._wait(refs, None, f"running {method}")[0]

    def run_sharded(self, method: str, batch: Batch, *args: Any) -> Any:
        shards = dp_shard_indices(batch.seq_lens, self.parallel.dp_size)
        by_dp = {dp: self._ray.put(batch.select(idx)) for dp, idx in enumerate(shards)}
        refs = [
            actor.call.remote(method, by_dp[info.dp_rank], *args)
            for actor, info in zip(self._actors, self._infos, strict=True)
        ]
        return self._wait(refs, None, f"running {method}")[0]

    def close(self) -> None:
        ray = self._ray
        if self._actors:
            with contextlib.suppress(Exception):
                ray.get([a.call.remote("close") for a in self._actors], timeout=60)
        for actor in self._actors:
            ray.kill(actor)
        self._actors = []
        if self._pg is not None:
            self._remove_pg(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
