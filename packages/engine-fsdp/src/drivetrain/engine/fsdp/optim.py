"""AdamW with the api's LR schedule, and gradient clipping over sharded gradients."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from drivetrain.api import OptimConfig
from drivetrain.runtime.schedule import lr_multiplier


def build_optimizer(
    model: nn.Module, config: OptimConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=device.type == "cuda",  # fused kernels exist on CUDA; CPU uses the foreach path
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, config)
    )
    return optimizer, scheduler


def clip_grad_norm(model: nn.Module, max_norm: float | None, *, fsdp1: bool) -> float:
    """Total gradient norm over all shards (same on every rank), clipping if ``max_norm``."""
    limit = math.inf if max_norm is None else max_norm
    if fsdp1:
        norm = model.clip_grad_norm_(limit)
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)
