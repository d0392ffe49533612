"""Moving parameters and optimizer state between host memory and the device between phases."""

from __future__ import annotations

import torch
from torch import nn


def move_model(model: nn.Module, device: torch.device) -> None:
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device != device:
            tensor.data = tensor.data.to(device, non_blocking=True)
            if tensor.grad is not None:
                tensor.grad.data = tensor.grad.data.to(device, non_blocking=True)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != device and key != "step":
                state[key] = value.to(device, non_blocking=True)
