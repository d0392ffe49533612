"""New weights in: checked by name and shape before any is applied, so a bad stream changes
nothing; and tensors as bytes, for crossing into another Python environment."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor


def collect_weights(weights: Iterable[NamedTensor]) -> list[tuple[str, torch.Tensor]]:
    """The stream as a list, each tensor copied (to the CPU) as it arrives: a stream's tensors
    may be views of the sender's reused buffers, valid only until the next one."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]


def stage_weights(
    weights: Iterable[NamedTensor], expected: Mapping[str, tuple[int, ...]], *, copy: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Collect the stream, raising ``KeyError`` for a name not in ``expected`` and
    ``ValueError`` for a wrong shape. The tensors are copied (the contract lets the sender reuse
    its buffers once the stream advances) unless ``copy=False`` says they already were."""
    staged = []
    for name, tensor in weights:
        if name not in expected:
            near = sorted(expected)[:8]
            raise KeyError(f"unknown weight {name!r}; the model has e.g. {near}")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model has "
                f"{tuple(expected[name])}"
            )
        staged.append((name, tensor.detach().to("cpu", copy=copy)))
    return staged


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_bytes(tensor: torch.Tensor) -> tuple[dict[str, Any], memoryview]:
    """Metadata and raw bytes of a tensor (any dtype, bf16 included), independent of the
    torch version at either end."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    meta = {"shape": tuple(tensor.shape), "dtype": dtype_name(tensor.dtype)}
    return meta, memoryview(flat.view(torch.uint8).numpy())


def tensor_from_bytes(meta: Mapping[str, Any], data: bytes | bytearray) -> torch.Tensor:
    """The tensor :func:`tensor_to_bytes` described; ``ValueError`` when ``meta`` (read from
    another process) names no dtype or does not match the byte count."""
    dtype = getattr(torch, str(meta["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{meta['dtype']!r} is not a torch dtype")
    shape = tuple(int(size) for size in meta["shape"])
    expected = math.prod(shape) * dtype.itemsize
    if len(data) != expected:
        raise ValueError(
            f"a {meta['dtype']} tensor of shape {shape} is {expected} bytes, got {len(data)}"
        )
    if len(data) == 0:
        return torch.empty(shape, dtype=dtype)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
