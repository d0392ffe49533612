"""Process group, device and device-mesh set-up (torchrun's environment convention)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from drivetrain.api import ConfigError
from drivetrain.runtime.devices import BACKENDS


def ensure_process_group(device: torch.device) -> None:
    """Join the group torchrun/Ray describe in the environment, or form a world of one.

    On CUDA the group also gets gloo for host tensors (CPU-offloaded shards, object
    collectives), so nothing fails with "no backend for device type cpu"."""
    if device.type == "cuda":  # also when someone else created the group
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else BACKENDS[device.type]
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:  # in-process use: a private world of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@dataclass(frozen=True)
class Meshes:
    """``fsdp``: the mesh parameters are sharded/replicated over (1-D, or 2-D for hybrid);
    ``sp``: the Ulysses group of this rank; data-parallel = world / sp."""

    fsdp: DeviceMesh
    sp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int


def build_meshes(device: torch.device, ulysses_size: int, shard_size: int) -> Meshes:
    """``shard_size``: ranks that shard parameters among themselves (0: the whole world);
    a smaller group gives a 2-D (replicate, shard) mesh: hybrid sharding, or no sharding at 1."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % ulysses_size:
        raise ConfigError(f"ulysses_size={ulysses_size} does not divide world size {world}")
    if shard_size:
        if world % shard_size:
            raise ConfigError(f"shard group size {shard_size} does not divide world size {world}")
        fsdp = init_device_mesh(
            device.type, (world // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
        )
    else:
        fsdp = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    # ranks [dp, sp] row-major: the sp peers of a rank are consecutive
    dp_size = world // ulysses_size
    grid = torch.arange(world).view(dp_size, ulysses_size)
    sp_group = dp_group = None
    for row in grid.tolist():
        group = dist.new_group(row) if ulysses_size > 1 else None
        if rank in row:
            sp_group = group
    for column in grid.t().tolist():
        group = dist.new_group(column)
        if rank in column:
            dp_group = group
    assert dp_group is not None
    return Meshes(
        fsdp, sp_group, dp_group, rank // ulysses_size, dp_size, rank % ulysses_size, ulysses_size
    )
