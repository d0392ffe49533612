"""Ray worker group: N actors, one rank each, forming one torch.distributed group.

Actors are placed with a placement group (one bundle per rank, packed onto as few nodes as
possible), so the same code runs on a laptop (``ray.init()`` started here) and on a multi-node
cluster joined by address (``workers.ray_address=auto`` or ``host:port``). Rank 0's actor picks
the rendezvous address and port on its own node; every actor exports torchrun's variables
before building its worker, so engines need nothing Ray-specific. ``share`` < 1 leaves part of
each bundle free for actors colocated with the ranks (an RL rollout on the same device).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any, NamedTuple

from drivetrain.api import Batch, ParallelInfo
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.workers.group import WorkerFactory, WorkerGroup
from drivetrain.trainer.workers.ray_runtime import ensure_ray, wait_all
from drivetrain.trainer.workers.shared_paths import SharedPaths, marked, refuse_unseen, unseen


class NodeOf(NamedTuple):
    """Where an actor runs: its Ray node (the id, unique per node even when several share an
    address, as in a cluster simulated on one machine) and the node's IP."""

    node_id: str
    ip: str

    def __str__(self) -> str:
        return f"{self.node_id[:8]} ({self.ip})"


def this_node() -> NodeOf:
    import ray

    return NodeOf(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())


def placement_line(what: str, nodes: list[NodeOf]) -> str:
    """``what`` and the nodes it runs on, in order: ``actor ranks on 2 node(s): ...``."""
    count = len(set(nodes))
    return f"{what} on {count} node(s): " + ", ".join(f"{i} {n}" for i, n in enumerate(nodes))


def rendezvous_address() -> tuple[str, int]:
    """This node's IP (as Ray sees it) and a free TCP port on it."""
    import ray

    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind(("", 0))
        return host, s.getsockname()[1]


class RankActor:
    """The actor body: the worker, created once torchrun's variables are set."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node(self) -> NodeOf:
        return this_node()

    def unseen(self, paths: SharedPaths) -> list[str]:
        return unseen(paths)

    def pid(self) -> int:
        return os.getpid()

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def setup(self, factory: WorkerFactory, env: dict[str, str]) -> ParallelInfo:
        import torch

        # torch.distributed reads these when the worker's engines initialize
        os.environ.update(env)
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        self.worker = factory()
        return self.worker.initialize()

    def call(self, method: str, *args: Any) -> Any:
        assert self.worker is not None, "setup() first"
        return getattr(self.worker, method)(*args)


class RayWorkerGroup(WorkerGroup):
    def __init__(
        self,
        factory: WorkerFactory,
        workers: WorkersConfig,
        *,
        shared: SharedPaths,
        share: float = 1.0,
    ) -> None:
        # before `import ray`: ensure_ray sets what Ray reads at import
        self._started_ray = ensure_ray(workers, min_cpus=workers.num * workers.cpus_per_worker)
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_pg = remove_placement_group
        self._actors: list[Any] = []
        self._pg = None
        self._broken = False
        self.is_writer = True
        try:
            gpus = workers.gpus_per_worker
            if gpus < 0:
                gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= workers.num else 0.0
            self.bundle: dict[str, float] = {"CPU": workers.cpus_per_worker}
            if gpus > 0:
                self.bundle["GPU"] = gpus
            self._pg = placement_group(
                [dict(self.bundle) for _ in range(workers.num)], strategy="PACK"
            )
            wait_all(self._pg.ready(), workers.start_timeout_s, "placing the workers")
            actor_class = ray.remote(RankActor)
            self._actors = [
                actor_class.options(
                    num_cpus=workers.cpus_per_worker * share,
                    num_gpus=gpus * share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._pg, placement_group_bundle_index=rank
                    ),
                ).remote()
                for rank in range(workers.num)
            ]
            self.nodes: list[NodeOf] = wait_all(
                [a.node.remote() for a in self._actors], workers.start_timeout_s, "starting"
            )
            self._check_sees(shared)
            addr, port = wait_all(self._actors[0].rendezvous.remote(), 60, "rendezvous")
            setups = [
                actor.setup.remote(factory, self._rank_env(rank, self.nodes, addr, port, gpus > 0))
                for rank, actor in enumerate(self._actors)
            ]
            self._infos: list[ParallelInfo] = self._wait(
                setups, workers.start_timeout_s, "initializing the engines"
            )
        except BaseException:
            self._broken = True
            self.close()
            raise

    @property
    def placement_group(self) -> Any:
        return self._pg

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def _check_sees(self, shared: SharedPaths) -> None:
        """Every rank's node sees the output directory and the model (one line if not)."""
        with marked(shared) as paths:
            found = wait_all(
                [a.unseen.remote(paths) for a in self._actors], 60, "checking the shared paths"
            )
        refuse_unseen({rank: (str(self.nodes[rank]), f) for rank, f in enumerate(found)})

    def where(self) -> str:
        return placement_line("actor ranks", self.nodes)

    @staticmethod
    def _rank_env(
        rank: int, nodes: list[NodeOf], addr: str, port: int, gpu: bool
    ) -> dict[str, str]:
        same_node = [r for r, node in enumerate(nodes) if node == nodes[rank]]
        return {
            "RANK": str(rank),
            "WORLD_SIZE": str(len(nodes)),
            # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is always 0.
            "LOCAL_RANK": "0" if gpu else str(same_node.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(same_node)),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(port),
        }

    def _wait(self, refs: Any, timeout: float | None, what: str) -> Any:
        try:
            return wait_all(refs, timeout, what)
        except BaseException:
            # a failed rank leaves its peers in a collective that will never finish
            self._broken = True
            raise

    @property
    def parallel(self) -> ParallelInfo:
        return self._infos[0]

    def _run_all(self, name: str, args: tuple[Any, ...]) -> Any:
        refs = [a.call.remote(name, *args) for a in self._actors]
        return self._wait(refs, None, f"running {name}")[0]

    def _sharded_refs(self, method: str, batch: Batch, args: tuple) -> tuple[list, list]:
        shards = batch.dp_shards(self.parallel.dp_size)
        by_dp = {dp: self._ray.put(batch.select(idx)) for dp, idx in enumerate(shards)}
        refs = [
            actor.call.remote(method, by_dp[info.dp_rank], *args)
            for actor, info in zip(self._actors, self._infos, strict=True)
        ]
        return shards, refs

    def _run_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> Any:
        _, refs = self._sharded_refs(name, batch, args)
        return self._wait(refs, None, f"running {name}")[0]

    def _gather_sharded(self, name: str, batch: Batch, args: tuple[Any, ...]) -> list[Any]:
        shards, refs = self._sharded_refs(name, batch, args)
        results = self._wait(refs, None, f"running {name}")
        first_output = {}
        for info, result in zip(self._infos, results, strict=True):
            if info.is_output_rank:
                first_output.setdefault(info.dp_rank, result)
        return [first_output[dp] for dp in range(len(shards))]

    def close(self) -> None:
        ray = self._ray
        if self._actors and not self._broken:
            with contextlib.suppress(Exception):
                ray.get([a.call.remote("close") for a in self._actors], timeout=60)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors = []
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._remove_pg(self._pg)
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False
