"""New weights in: applied tensor by tensor as they arrive (each checked by name and shape
before it is written), or checked and staged whole where a backend loads them at once; and
tensors as bytes, for crossing into another Python environment."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.runtime.request_queue import WeightUpdate


def collect_weights(weights: Iterable[NamedTensor]) -> list[tuple[str, torch.Tensor]]:
    """The stream as a list, each tensor copied (to the CPU) as it arrives: a stream's tensors
    may be views of the sender's reused buffers, valid only until the next one."""
    return [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]


def _check(name: str, tensor: torch.Tensor, expected: Mapping[str, Any]) -> None:
    """``KeyError`` for a name the model lacks, ``ValueError`` for a wrong shape."""
    if name not in expected:
        raise KeyError(f"unknown weight {name!r}; the model has e.g. {sorted(expected)[:8]}")
    target = expected[name]
    shape = tuple(target.shape) if isinstance(target, torch.Tensor) else tuple(target)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model has {shape}")


def apply_weights(
    weights: Iterable[NamedTensor], params: Mapping[str, torch.Tensor], update: WeightUpdate
) -> int:
    """Copy each tensor of the stream into the model's tensor of that name as it arrives (no
    staging: a stream's tensors may be views of a transport's buffers, each valid until the
    next). A bad name or shape raises before that tensor is written; ``update.changed`` is set
    before the first write. A tensor a transport already wrote into ``params`` (see
    :func:`destination`) is the parameter's own memory and is not copied again. Returns the
    number of tensors."""
    count = 0
    with torch.no_grad():
        for name, tensor in weights:
            target = params.get(name)
            if tensor is not target:  # else the transport wrote it in place (its destination)
                _check(name, tensor, params)
                update.changed = True
                if not _same_memory(target, tensor):
                    target.copy_(tensor)
            count += 1
    return count


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is ``a``'s memory as it is (a detached alias: ``copy_`` would still copy
    every byte onto itself)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def destination(
    params: Mapping[str, torch.Tensor],
    update: WeightUpdate | None,
    name: str,
    shape: tuple[int, ...],
    dtype: str,
) -> torch.Tensor | None:
    """``Rollout.weight_destination`` for a model whose weights are ``params``: the tensor of
    that name when an update is in progress and it has this shape and dtype."""
    target = params.get(name)
    if update is None or target is None:
        return None
    if target.shape != shape or _DTYPE_NAMES.get(target.dtype) != dtype:
        return None
    update.changed = True  # the transport writes into it from now on
    return target


def checked_clones(
    weights: Iterable[NamedTensor], expected: Mapping[str, tuple[int, ...]]
) -> Iterator[NamedTensor]:
    """The stream, each tensor checked (:func:`stage_weights`' errors) and cloned where it
    is (a GPU tensor stays on the GPU), for a loader that holds on to tensors for a while
    (vLLM keeps a layer's until the layer is complete); a stream's tensor is valid only until
    the next one."""
    for name, tensor in weights:
        _check(name, tensor, expected)
        yield name, tensor.detach().clone()


def device_buckets(
    weights: Iterable[NamedTensor],
    expected: Mapping[str, tuple[int, ...]],
    device: torch.device | str,
    bucket_bytes: int,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The stream as it arrives, each tensor checked and copied onto ``device``, in
    consecutive groups of at most ``bucket_bytes`` (a larger tensor goes alone): for a loader
    that takes a group of tensors per call. At most two groups are on the device at once, the
    one being filled and the one the caller still holds."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        _check(name, tensor, expected)
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor.detach().to(device, copy=True)))
        size += nbytes
    if bucket:
        yield bucket


def stage_weights(
    weights: Iterable[NamedTensor], expected: Mapping[str, tuple[int, ...]]
) -> list[tuple[str, torch.Tensor]]:
    """Collect the stream, raising ``KeyError`` for a name not in ``expected`` and
    ``ValueError`` for a wrong shape. The tensors are copied to the CPU (the contract lets the
    sender reuse its buffers once the stream advances)."""
    staged = []
    for name, tensor in weights:
        _check(name, tensor, expected)
        staged.append((name, tensor.detach().to("cpu", copy=True)))
    return staged


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_DTYPE_NAMES = {  # dtype_name of each dtype, looked up for every weight of every update
    dtype: dtype_name(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
}


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
