"""Where the roles run, and how the actor's weights reach the rollouts.

- ``inprocess``: one actor rank and the rollout(s) in this process; new weights go over the
  ``direct`` transport, which hands the engine's export tensors to the rollouts as they are
  (same address space: nothing copied on the way); a rollout in its own server process
  (``rollout.python``) gets them over ``colocated``.
- ``colocated`` (Ray): the actor's ranks are Ray actors; rollout replica ``i`` is a Ray actor
  in rank ``i``'s placement bundle, sharing its CPU/GPU, asleep while the actor trains; weights
  move over the ``colocated`` transport (shared memory on CPU, CUDA IPC on GPU).
- ``separate`` (Ray): rollout replicas get their own bundles (their own devices); weights move
  over the ``broadcast`` transport (the rollouts' own NCCL/HCCL/gloo group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from drivetrain.api import registry
from drivetrain.api.config import RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.weight_sync import Topology
from drivetrain.runtime.remote_rollout import RemoteRollout
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.rl.config import PlacementConfig
from drivetrain.trainer.rl.rollout_pool import RayChannel, RolloutActor, RolloutPool
from drivetrain.trainer.sync_manager import WeightSyncManager, connect_rollouts
from drivetrain.trainer.workers.group import LocalWorkerGroup, WorkerGroup
from drivetrain.trainer.workers.ray_runtime import driver_env, ensure_ray, wait_all
from drivetrain.trainer.workers.role_worker import RoleSpec, RoleWorker

DEFAULT_TRANSPORT = {"colocated": "colocated", "separate": "broadcast"}


def resolve_mode(placement: PlacementConfig, workers: WorkersConfig) -> str:
    if placement.mode != "auto":
        mode = placement.mode
    else:
        mode = "inprocess" if workers.num == 1 and workers.launcher != "ray" else "colocated"
    if mode == "inprocess" and workers.num != 1:
        raise ConfigError(
            f"placement.mode=inprocess runs one actor rank, but workers.num={workers.num}; "
            "use placement.mode=colocated or separate (Ray)"
        )
    if workers.launcher == "torchrun":
        raise ConfigError("RL runs in-process or on Ray; torchrun launching is for SFT")
    return mode


def resolve_transport(requested: str, mode: str, *, rollout_process: bool = False) -> str:
    """The transport of a placement. In-process, a rollout running in its own server process
    (``rollout.python``) is not in this address space: the weights cross over ``colocated``
    (shared memory / CUDA IPC) unless another transport is asked for."""
    if mode == "inprocess":
        if not rollout_process:
            return "direct"
        if requested == "direct":  # refused here, not as 'unknown ckpt-engine direct' there
            raise ConfigError(
                "the direct transport cannot reach a rollout in its own process "
                "(rollout.python); drop --weight-sync or pick colocated"
            )
        return "colocated" if requested == "auto" else requested
    return DEFAULT_TRANSPORT[mode] if requested == "auto" else requested


def transport_config(transport: str, config: WeightSyncConfig) -> WeightSyncConfig:
    """The transport's own config class, from the shared knobs when the job was configured
    before the transport was known (``--weight-sync auto``)."""
    cls = registry.ckpt_engines.load_config_class(transport, WeightSyncConfig)
    if isinstance(config, cls):
        return config
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(WeightSyncConfig)}
    return cls(**shared)


def connect_weights(
    group: WorkerGroup,
    pool: RolloutPool,
    transport: str,
    config: WeightSyncConfig,
    *,
    colocated: bool = False,
) -> WeightSyncManager:
    """Join the actor's rank 0 and every rollout into the placement's transport once; the
    returned manager (the weight path's one owner) runs every sync over it."""
    endpoint = group.run_all(RoleWorker.sync_prepare, transport, config)

    def sender(topology: Topology, endpoint: Any) -> None:
        group.run_all(RoleWorker.sync_connect, topology, endpoint)

    receivers = connect_rollouts(sender, endpoint, transport, config, pool.rollouts)
    send = functools.partial(group.run_all, RoleWorker.sync_send)
    return WeightSyncManager(send, pool.rollouts, receivers, colocated=colocated)


@dataclass
class Placement:
    mode: str
    group: WorkerGroup
    pool: RolloutPool
    weights: WeightSyncManager
    started_ray: bool = False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.weights.close()
        self.pool.shutdown()
        with contextlib.suppress(Exception):
            self.group.close()
        for rollout in self.pool.rollouts:
            if isinstance(rollout, RemoteRollout) and isinstance(rollout.channel, RayChannel):
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(rollout.channel.actor)
        if self.started_ray:
            import ray

            ray.shutdown()


def build_placement(
    mode: str,
    *,
    roles: dict[str, RoleSpec],
    plugins: tuple[str, ...],
    workers: WorkersConfig,
    placement: PlacementConfig,
    rollout_name: str,
    rollout_config: RolloutConfig,
    transport: str,
    sync_config: WeightSyncConfig,
) -> Placement:
    factory = functools.partial(RoleWorker, roles, plugins)
    if mode == "inprocess":
        group: WorkerGroup = LocalWorkerGroup(factory)
        try:
            make = registry.rollouts.load(rollout_name)
            rollouts = [make(rollout_config) for _ in range(placement.rollout_replicas)]
        except BaseException:
            group.close()
            raise
        pool = RolloutPool(rollouts)
        try:
            weights = connect_weights(
                group, pool, transport, transport_config(transport, sync_config)
            )
        except BaseException:
            pool.shutdown()
            group.close()
            raise
        return Placement(mode, group, pool, weights)
    return _ray_placement(
        mode, factory, workers, placement, rollout_name, rollout_config, transport, sync_config
    )


def _ray_placement(
    mode: str,
    factory: Any,
    workers: WorkersConfig,
    placement: PlacementConfig,
    rollout_name: str,
    rollout_config: RolloutConfig,
    transport: str,
    sync_config: WeightSyncConfig,
) -> Placement:
    colocated = mode == "colocated"
    if colocated and placement.rollout_replicas > workers.num:
        raise ConfigError(
            f"placement.rollout_replicas={placement.rollout_replicas} colocated replicas need as "
            f"many actor ranks, workers.num={workers.num}"
        )
    sync_config = transport_config(transport, sync_config)
    extra = 0.0 if colocated else placement.rollout_replicas * placement.rollout_cpus
    # before `import ray`: ensure_ray sets what Ray reads at import
    started = ensure_ray(workers, min_cpus=workers.num * workers.cpus_per_worker + extra)
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from drivetrain.trainer.workers.ray_group import RayWorkerGroup

    group = None
    handles: list[RemoteRollout] = []
    try:
        share = 1.0 - placement.colocated_share if colocated else 1.0
        group = RayWorkerGroup(factory, workers, share=share)
        actor_class = ray.remote(RolloutActor)
        env = driver_env()
        if colocated:
            options = [
                dict(
                    num_cpus=group.bundle["CPU"] * placement.colocated_share,
                    num_gpus=group.bundle.get("GPU", 0.0) * placement.colocated_share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group.placement_group, placement_group_bundle_index=i
                    ),
                )
                for i in range(placement.rollout_replicas)
            ]
        else:
            gpus = placement.rollout_gpus
            if gpus < 0:
                free = ray.available_resources().get("GPU", 0)
                gpus = 1.0 if free >= placement.rollout_replicas else 0.0
            bundle = {"CPU": placement.rollout_cpus, **({"GPU": gpus} if gpus else {})}
            pg = placement_group([dict(bundle)] * placement.rollout_replicas, strategy="PACK")
            wait_all(pg.ready(), workers.start_timeout_s, "placing the rollouts")
            options = [
                dict(
                    num_cpus=placement.rollout_cpus,
                    num_gpus=gpus,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    ),
                )
                for i in range(placement.rollout_replicas)
            ]
        actors = [
            actor_class.options(**opt).remote(rollout_name, rollout_config, env) for opt in options
        ]
        wait_all([a.pid.remote() for a in actors], workers.start_timeout_s, "starting rollouts")
        handles = [
            RemoteRollout(rollout_config, RayChannel(a, workers.start_timeout_s * 10))
            for a in actors
        ]
        pool = RolloutPool(handles)
        weights = connect_weights(group, pool, transport, sync_config, colocated=colocated)
        return Placement(mode, group, pool, weights, started_ray=started)
    except BaseException:
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle.channel.actor)
        if group is not None:
            group.close()
        if started:
            ray.shutdown()
        raise
