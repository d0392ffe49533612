"""Megatron-Core model chunks wrapped by the standalone Megatron-FSDP package.

Megatron-FSDP shards each chunk's parameters, gradients and optimizer state over the
data-parallel group of megatron-core's ``parallel_state`` and keeps tensor-parallel shards as
they are: its device mesh is that rank's data-parallel x tensor-parallel grid. Pipeline stages
are separate meshes (each stage's ranks shard their own layers). The wrapper's ``ddp_config``
is megatron-core's class with ``use_megatron_fsdp=True``, which is what megatron-core's
optimizer, ``finalize_model_grads`` and gradient clipping look for.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.engine.megatron_fsdp.config import MegatronFSDPConfig

log = logging.getLogger(__name__)

# megatron_fsdp code that pins tensors to "the current CUDA device" (cpu_compat mechanism 1):
# MegatronFSDP.__init__ compares its device with torch.cuda.current_device(); the buffers
# allocate on it and all-gather / reduce-scatter their buckets there
_HOST_MODULES = (
    "megatron_fsdp.megatron_fsdp",
    "megatron_fsdp.param_and_grad_buffer",
    "megatron_fsdp.utils",
)
# ... and calls Tensor.cuda() (mechanism 2): validate_uneven_dtensor moves its shard-size check
# tensor to the GPU before the all-gather (every sharded parameter, at wrap time)
_HOST_METHOD_SCOPES = (("megatron_fsdp.uneven_dtensor", None, "validate_uneven_dtensor"),)


def _mesh(device: torch.device) -> Any:
    """This rank's data-parallel x tensor-parallel grid as a ``DeviceMesh`` over megatron's
    existing groups (no new process groups)."""
    from megatron.core import parallel_state as ps
    from torch.distributed.device_mesh import DeviceMesh

    dp_group, tp_group = ps.get_data_parallel_group(), ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group)
    # megatron orders ranks tp fastest: a data-parallel peer's TP group is its aligned block
    rows = [
        [peer - peer % tp + j for j in range(tp)] for peer in dist.get_process_group_ranks(dp_group)
    ]
    mine = dist.get_process_group_ranks(tp_group)
    if mine not in rows:
        raise RuntimeError(f"tensor-parallel group {mine} is not a row of the mesh {rows}")
    return DeviceMesh.from_group(
        [dp_group, tp_group], device_type=device.type, mesh=rows, mesh_dim_names=("dp", "tp")
    )


def _strategy(cfg: MegatronFSDPConfig) -> str:
    """The configured strategy, except ``optim`` at data-parallel size 1: there Megatron-FSDP
    0.3.1 keeps gradients unsharded and ``optim_grads`` / ``optim_grads_params`` add each
    micro-batch's accumulated buffer into itself again (measured at TP=2: grad norm 23.2
    instead of 2.60 with 4 micro-batches, 5.19 with 1). Nothing is sharded at DP=1 anyway."""
    from megatron.core import parallel_state as ps

    if ps.get_data_parallel_world_size() == 1 and cfg.sharding_strategy != "optim":
        log.info(
            "megatron_fsdp: data-parallel size 1, sharding_strategy %r runs as 'optim'",
            cfg.sharding_strategy,
        )
        return "optim"
    return cfg.sharding_strategy


def _ddp_config(cfg: MegatronFSDPConfig, strategy: str, device: torch.device) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    knobs = {
        name: getattr(cfg, name)
        for name in ("overlap_grad_reduce", "overlap_param_gather", "bucket_size")
        if getattr(cfg, name) is not None
    }
    return DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        use_distributed_optimizer=True,
        data_parallel_sharding_strategy=strategy,
        grad_reduce_in_fp32=True,
        # gloo has no PREMUL_SUM, which the fused gradient division uses
        gradient_reduce_div_fusion=device.type != "cpu",
        **knobs,
    )


def wrap_chunks(
    chunks: list[Any], tcfg: Any, cfg: MegatronFSDPConfig, device: torch.device
) -> list[Any]:
    """Each ``GPTModel`` chunk inside its own ``MegatronFSDP``; transformer layers are the
    units that ``optim_grads_params`` gathers and frees one at a time."""
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron_fsdp import FSDPDistributedIndex, MegatronFSDP

    if device.type == "cpu":
        from drivetrain.engine.megatron import cpu_compat

        cpu_compat.extend(_HOST_MODULES, _HOST_METHOD_SCOPES)
    if tcfg.num_moe_experts:
        raise ValueError(
            "the megatron_fsdp engine does not support mixture-of-experts models "
            "yet; use engine megatron"
        )
    if tcfg.pipeline_model_parallel_size > 1 and chunks[0].share_embeddings_and_output_weights:
        # the last stage's copy of a tied embedding gets a plain (not DTensor) gradient from
        # finalize_model_grads, which megatron-core's grad norm then cannot read
        raise ValueError(
            "the megatron_fsdp engine cannot run tied embeddings "
            "(tie_word_embeddings) with pipeline_parallel > 1 yet; use engine "
            "megatron or pipeline_parallel=1"
        )
    index = FSDPDistributedIndex(device_mesh=_mesh(device), dp_shard_dim="dp", tp_dim="tp")
    strategy = _strategy(cfg)
    units = [TransformerLayer] if strategy == "optim_grads_params" else []
    wrapped = []
    for chunk in chunks:
        model = MegatronFSDP(
            module=chunk,
            dist_index=index,
            ddp_config=_ddp_config(cfg, strategy, device),
            fsdp_unit_modules=units,
            device=device,
            # our losses are normalised by the global token count already (see engine-megatron)
            calculate_per_token_loss=True,
        )
        model.config = tcfg  # megatron's schedules read the wrapper's transformer config
        wrapped.append(model)
    return wrapped
