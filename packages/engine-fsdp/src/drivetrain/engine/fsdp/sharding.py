"""Wrapping the model with FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``).

Each decoder layer is its own unit; the root unit (the :class:`TokenOutputModel`) holds the
embeddings, final norm and head, so tied embedding/head weights stay in one unit. Parameters
are kept in fp32; ``model.dtype`` is the compute dtype (mixed precision), gradients are reduced
in ``reduce_dtype``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.model import DTYPES, decoder_layers


def _compute_dtypes(config: FSDPConfig) -> tuple[torch.dtype | None, torch.dtype | None]:
    param = DTYPES[config.model.dtype]
    if param == torch.float32:
        return None, None  # plain fp32: no casting at all
    return param, DTYPES[config.reduce_dtype]


def wrap_fsdp2(
    model: nn.Module, config: FSDPConfig, mesh: DeviceMesh, device: torch.device
) -> nn.Module:
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    param_dtype, reduce_dtype = _compute_dtypes(config)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # pinned host memory needs an accelerator; on a CPU-only machine it fails (FACTS)
    offload = (
        CPUOffloadPolicy(pin_memory=device.type != "cpu")
        if config.cpu_offload_policy
        else OffloadPolicy()
    )
    reshard = config.strategy != "shard_grad_op"
    for layer in decoder_layers(model.hf):
        fully_shard(
            layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload
    )
    return model


def wrap_fsdp1(
    model: nn.Module, config: FSDPConfig, mesh: DeviceMesh, device: torch.device
) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategies = {
        "full_shard": ShardingStrategy.FULL_SHARD,
        "shard_grad_op": ShardingStrategy.SHARD_GRAD_OP,
        "hybrid_shard": ShardingStrategy.HYBRID_SHARD,
        "no_shard": ShardingStrategy.NO_SHARD,
    }
    param_dtype, reduce_dtype = _compute_dtypes(config)
    mixed = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)  # fp32 buffers
    layer_types = {type(layer) for layer in decoder_layers(model.hf)}
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(layer_types),
        sharding_strategy=strategies[config.strategy],
        mixed_precision=mixed if param_dtype is not None else None,
        device_mesh=mesh if config.strategy == "hybrid_shard" else None,
        process_group=None if config.strategy == "hybrid_shard" else mesh.get_group(),
        device_id=device,  # explicit, also for CPU (gloo): FSDP1 otherwise looks for a GPU
        use_orig_params=True,
        sync_module_states=False,
    )


def broadcast_from_rank0(
    model: nn.Module, full: dict[str, torch.Tensor] | None, device: torch.device
) -> None:
    """Fill every rank's parameter shards from rank 0's full state dict, one parameter at a
    time (ranks other than 0 built the model on the meta device and hold no weights yet)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor

    if dist.get_rank() != 0:
        buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
        model.to_empty(device=device)
        for name, buffer in model.named_buffers():  # to_empty dropped the real buffers
            buffer.data.copy_(buffers[name])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if full is not None:
                source = full[name].to(device=device, dtype=param.dtype)
            else:
                source = torch.empty(param.shape, dtype=param.dtype, device=device)
            assert isinstance(param, DTensor), f"{name} is not sharded"
            # scatter from rank 0, keep only this rank's shard
            shard = distribute_tensor(source, param.device_mesh, param.placements, src_data_rank=0)
            param.to_local().copy_(shard.to_local())
