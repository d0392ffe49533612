"""Every module's output in one or more forwards, by name, for comparing two stacks op by op
(``Engine.trace_ops``, ``Rollout.trace_ops``: ``drivetrain diagnose mismatch``).

A module's output is its first tensor (attention returns ``(output, weights)``; the rotary
embedding ``(cos, sin)``), recorded on the host in float32 with the batch dimension dropped
(one sequence), so that calls over successive positions (a prefill, then decode steps)
concatenate along positions.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class OpTrace:
    """Outputs per module name, in the order each module first ran."""

    def __init__(self) -> None:
        self.calls: dict[str, list[torch.Tensor]] = {}

    def outputs(self) -> dict[str, torch.Tensor]:
        """Each module's calls concatenated along positions (``[positions, ...]``)."""
        return {name: torch.cat(calls, 0) for name, calls in self.calls.items()}


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return getattr(output, "last_hidden_state", None)


@contextmanager
def trace_modules(model: nn.Module) -> Iterator[OpTrace]:
    """Record every named module of ``model`` (not the model itself) while the block runs."""
    trace = OpTrace()
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def record(_module: nn.Module, _args: Any, output: Any, name: str = name) -> None:
            tensor = _first_tensor(output)
            if tensor is not None and tensor.dim() >= 2 and tensor.shape[0] == 1:
                trace.calls.setdefault(name, []).append(tensor[0].detach().float().cpu())

        handles.append(module.register_forward_hook(record))
    try:
        yield trace
    finally:
        for handle in handles:
            handle.remove()
