"""Moving parameters and optimizer state between host memory and the device between phases."""

from __future__ import annotations

import torch
from torch import nn


def move_model(model: nn.Module, device: torch.device, *, fsdp1: bool) -> None:
    """FSDP2 and plain modules: ``Module.to`` (FSDP2 re-points its sharded parameters).
    FSDP1: its flat parameters, which ``parameters()`` does not show under use_orig_params."""
    if not fsdp1:
        model.to(device, non_blocking=True)
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    handles = [unit._handle for unit in FSDP.fsdp_modules(model) if unit._handle is not None]
    for handle in handles:
        flat = handle.flat_param
        if flat.device != device:
            handle.flat_param_to(device, non_blocking=True)
            flat._local_shard = flat.data
    for buffer in model.buffers():
        buffer.data = buffer.data.to(device, non_blocking=True)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    # fused and capturable AdamW keep ``step`` beside the parameters; the others on the host
    steps_on_host = not any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or value.device == device:
                continue
            if key == "step" and steps_on_host:
                continue
            state[key] = value.to(device, non_blocking=True)


def release_device_memory(device: torch.device) -> None:
    """Finish the asynchronous copies to host, then hand the freed blocks back (e.g. to a
    colocated rollout)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
