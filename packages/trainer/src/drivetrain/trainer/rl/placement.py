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
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.api import Rollout, registry
from drivetrain.api.config import RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import ConfigError
from drivetrain.api.weight_sync import Topology
from drivetrain.runtime.remote_rollout import RemoteRollout
from drivetrain.runtime.rollout_service import RolloutService
from drivetrain.trainer.job_config import WorkersConfig
from drivetrain.trainer.rl.config import PlacementConfig
from drivetrain.trainer.rl.hosted import rollout_factory
from drivetrain.trainer.rl.ray_rollout import ACTOR_OPTIONS, RayChannel, RolloutActor
from drivetrain.trainer.rl.sync_manager import WeightSyncManager, connect_rollouts
from drivetrain.trainer.rl.sync_worker import SyncingWorker
from drivetrain.trainer.workers.group import LocalWorkerGroup, WorkerGroup
from drivetrain.trainer.workers.ray_runtime import driver_env, ensure_ray, wait_all
from drivetrain.trainer.workers.role_worker import RoleSpec
from drivetrain.trainer.workers.shared_paths import SharedPaths

log = logging.getLogger(__name__)

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


def takes_adapters(rollout_config: object) -> bool:
    """Whether rollouts of this config load LoRA adapters themselves (``rollout.lora``)."""
    lora = getattr(rollout_config, "lora", None)
    return bool(lora is not None and lora.enabled)


def rollout_service(rollouts: Sequence[Rollout], config: RolloutConfig) -> RolloutService:
    """The placement's one owner of rollout traffic (product code builds no other): every
    caller generates through it, and its user polls it (threads from ``poll_in_threads``); a
    replica that gives no token for ``rollout.stall_timeout_s`` while requests run fails."""
    return RolloutService(
        rollouts, name="rollouts", threads=False, stall_timeout_s=config.stall_timeout_s
    )


def connect_weights(
    group: WorkerGroup,
    rollouts: RolloutService,
    transport: str,
    config: WeightSyncConfig,
    *,
    colocated: bool = False,
    adapter: bool = False,
) -> WeightSyncManager:
    """Join the actor's rank 0 and every rollout into the placement's transport once; the
    returned manager (the weight path's one owner) runs every sync over it. ``adapter``: the
    rollouts take LoRA adapters (a LoRA actor sends its adapter alone)."""
    endpoint = group.run_all(SyncingWorker.sync_prepare, transport, config, adapter)

    def sender(topology: Topology, endpoint: Any) -> None:
        group.run_all(SyncingWorker.sync_connect, topology, endpoint)

    receivers = connect_rollouts(sender, endpoint, transport, config, rollouts.rollouts)
    send = functools.partial(group.run_all, SyncingWorker.sync_send)
    return WeightSyncManager(
        send,
        rollouts.rollouts,
        receivers,
        colocated=colocated,
        excused=rollouts.excused,
        provenance=config.provenance,
    )


@dataclass
class Placement:
    mode: str
    group: WorkerGroup
    rollouts: RolloutService
    weights: WeightSyncManager
    started_ray: bool = False
    where: str = ""  # on Ray: the nodes of the ranks and of the rollouts, in one line

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.weights.close()
        try:  # what fails here is logged by the service; the rest is torn down regardless
            self.rollouts.shutdown()
        except Exception:
            log.exception("shutting the rollouts down failed")
        with contextlib.suppress(Exception):
            self.group.close()
        for rollout in self.rollouts.rollouts:
            if isinstance(rollout, RemoteRollout) and isinstance(rollout.channel, RayChannel):
                import ray

                with contextlib.suppress(Exception):
                    ray.kill(rollout.channel.actor)
        if self.started_ray:
            import ray

            ray.shutdown()


@dataclass(frozen=True)
class PlacementSpec:
    """What a placement is built from, decided by the job before anything starts."""

    mode: str  # inprocess, colocated, separate (auto resolved)
    roles: dict[str, RoleSpec]
    plugins: tuple[str, ...]  # user modules every worker imports first (algorithm.plugins)
    workers: WorkersConfig
    placement: PlacementConfig
    rollout_name: str
    rollout_config: RolloutConfig
    transport: str
    sync_config: WeightSyncConfig
    shared: SharedPaths  # what every rank's node must see (a cluster's shared filesystem)


def build_placement(spec: PlacementSpec) -> Placement:
    factory = functools.partial(SyncingWorker, spec.roles, spec.plugins)
    if spec.mode != "inprocess":
        return _ray_placement(spec, factory)
    group: WorkerGroup = LocalWorkerGroup(factory)
    try:
        make = rollout_factory(spec.rollout_name, spec.rollout_config)
        rollouts = [make(spec.rollout_config) for _ in range(spec.placement.rollout_replicas)]
    except BaseException:
        group.close()
        raise
    service = rollout_service(rollouts, spec.rollout_config)
    try:
        sync_config = transport_config(spec.transport, spec.sync_config)
        weights = connect_weights(
            group, service, spec.transport, sync_config, adapter=takes_adapters(spec.rollout_config)
        )
    except BaseException:
        service.shutdown()
        group.close()
        raise
    return Placement(spec.mode, group, service, weights)


def _rollout_options(spec: PlacementSpec, group: Any) -> list[dict[str, Any]]:
    """Each Ray rollout actor's resources: a share of actor rank ``i``'s bundle (colocated), or
    a bundle of its own in a placement group of the rollouts (separate)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    p, replicas = spec.placement, range(spec.placement.rollout_replicas)
    if spec.mode == "colocated":
        return [
            dict(
                num_cpus=group.bundle["CPU"] * p.colocated_share,
                num_gpus=group.bundle.get("GPU", 0.0) * p.colocated_share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group.placement_group, placement_group_bundle_index=i
                ),
            )
            for i in replicas
        ]
    gpus = p.rollout_gpus
    if gpus < 0:
        gpus = 1.0 if ray.available_resources().get("GPU", 0) >= p.rollout_replicas else 0.0
    bundle = {"CPU": p.rollout_cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([dict(bundle)] * p.rollout_replicas, strategy="PACK")
    wait_all(pg.ready(), spec.workers.start_timeout_s, "placing the rollouts")
    return [
        dict(
            num_cpus=p.rollout_cpus,
            num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i
            ),
        )
        for i in replicas
    ]


def check_reaches(transport: str, trainer: Any, rollouts: Sequence[Any]) -> None:
    """Refuse, in one line, a transport that cannot cross machines when a rollout runs on
    another node than the actor's rank 0 (which sends the weights): shared memory or CUDA IPC
    handles mean nothing on another machine. Nodes compare as :class:`NodeOf` do."""
    away = [i for i, node in enumerate(rollouts) if node != trainer]
    if not away or "cross_node" in registry.ckpt_engines.spec(transport).capabilities:
        return
    raise ConfigError(
        f"rollout {away[0]} runs on node {rollouts[away[0]]} and the actor's rank 0 on "
        f"{trainer}, but the {transport} weight-sync transport stays on one machine (it does "
        "not declare cross_node); use --weight-sync broadcast (or disk on a shared filesystem)"
    )


def _ray_placement(spec: PlacementSpec, factory: Any) -> Placement:
    workers, p = spec.workers, spec.placement
    colocated = spec.mode == "colocated"
    if colocated and p.rollout_replicas > workers.num:
        raise ConfigError(
            f"placement.rollout_replicas={p.rollout_replicas} colocated replicas need as "
            f"many actor ranks, workers.num={workers.num}"
        )
    sync_config = transport_config(spec.transport, spec.sync_config)
    extra = 0.0 if colocated else p.rollout_replicas * p.rollout_cpus
    # before `import ray`: ensure_ray sets what Ray reads at import
    started = ensure_ray(workers, min_cpus=workers.num * workers.cpus_per_worker + extra)
    import ray

    from drivetrain.trainer.workers.ray_group import RayWorkerGroup, placement_line

    group = None
    handles: list[RemoteRollout] = []
    try:
        share = 1.0 - p.colocated_share if colocated else 1.0
        group = RayWorkerGroup(factory, workers, shared=spec.shared, share=share)
        actor_class, env = ray.remote(**ACTOR_OPTIONS)(RolloutActor), driver_env()
        actors = [
            actor_class.options(**options).remote(spec.rollout_name, spec.rollout_config, env)
            for options in _rollout_options(spec, group)
        ]
        pids = wait_all(
            [a.pid.remote() for a in actors], workers.start_timeout_s, "starting rollouts"
        )
        nodes = wait_all([a.node.remote() for a in actors], 60, "locating the rollouts")
        check_reaches(spec.transport, group.nodes[0], nodes)
        where = f"{group.where()}; {placement_line('rollouts', nodes)}"
        handles = [
            RemoteRollout(
                spec.rollout_config,
                RayChannel(
                    a,
                    workers.start_timeout_s * 10,
                    stall_timeout_s=spec.rollout_config.stall_timeout_s,
                    name=f"{k} (pid {pid})",
                ),
            )
            for k, (a, pid) in enumerate(zip(actors, pids, strict=True))
        ]
        service = rollout_service(handles, spec.rollout_config)
        weights = connect_weights(
            group,
            service,
            spec.transport,
            sync_config,
            colocated=colocated,
            adapter=takes_adapters(spec.rollout_config),
        )
        return Placement(spec.mode, group, service, weights, started_ray=started, where=where)
    except BaseException:
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle.channel.actor)
        if group is not None:
            group.close()
        if started:
            ray.shutdown()
        raise
