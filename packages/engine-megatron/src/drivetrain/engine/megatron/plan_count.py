"""Counting a planned step's device memory: the bytes of live (fake) tensors by storage, rounded
to the CUDA caching allocator's 512-byte blocks, labelled by the part of the step that made them;
and reads of fake values answered so that the engine's host bookkeeping runs.

Two things CUDA does that fake tensors on the CPU would not are done here as CUDA does them:
autograd adds a second gradient into the first in place (``InputBuffer`` refuses in-place adds on
tensor subclasses such as fake tensors), and RMSNorm keeps only its input and fp32 ``rstd`` for
backward (``aten._fused_rms_norm``; the CPU's composite path keeps fp32 temporaries: +6.2 GiB on
the 1.07B configuration).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

#: host bookkeeping runs on real tensors at most this large (offsets, cu_seqlens, counts)
HOST_ELEMENTS = 1 << 20


def _blocks(size: int) -> int:
    return -(-size // 512) * 512


class LiveBytes(TorchDispatchMode):
    """Live bytes by storage; ``part`` labels what is made now; at the peak, by part."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.sizes: dict[Any, tuple[int, str]] = {}
        self.by_part: dict[str, int] = defaultdict(int)
        self.live = self.peak = 0
        self.peak_by_part: dict[str, int] = {}
        self.part = "parameters"
        self.maker: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> autograd node

    def _drop(self, ref: Any) -> None:
        size, part = self.sizes.pop(ref)
        self.live -= size
        self.by_part[part] -= size

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self.seen:
            return
        ref = weakref.ref(storage, self._drop)
        size = _blocks(storage.nbytes())
        self.seen[storage] = ref
        self.sizes[ref] = (size, self.part)
        self.live += size
        self.by_part[self.part] += size
        if self.live > self.peak:
            self.peak, self.peak_by_part = self.live, dict(self.by_part)

    def reset_peak(self) -> None:
        self.peak, self.peak_by_part = self.live, dict(self.by_part)

    def _accumulates(self, func: Any, args: tuple) -> bool:
        """autograd's InputBuffer adding the current node's gradient to an earlier node's."""
        if func is not torch.ops.aten.add.Tensor or len(args) != 2:
            return False
        node = torch._C._current_autograd_node()
        first, second = args
        if node is None or not all(isinstance(t, torch.Tensor) for t in args):
            return False
        if first.shape != second.shape or first.dtype != second.dtype:
            return False
        made_first = self.maker.get(first.untyped_storage())
        made_second = self.maker.get(second.untyped_storage())
        return (
            first.is_contiguous() and made_first not in (None, id(node)) and made_second == id(node)
        )

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._accumulates(func, args):  # as on CUDA: the sum reuses the first's memory
            ref = self.seen.get(args[0].untyped_storage())
            if ref is not None and ref in self.sizes:
                size, part = self.sizes[ref]
                self.sizes[ref] = (0, part)
                self.live -= size
                self.by_part[part] -= size
        out = func(*args, **(kwargs or {}))
        node = torch._C._current_autograd_node()
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                if node is not None:
                    self.maker[tensor.untyped_storage()] = id(node)
                self._track(tensor)
        return out


class HostReads(TorchDispatchMode):
    """Small ops on real tensors run for real (the engine reads document offsets back with
    ``.tolist()``); a read of a fake value without a constant is 0 (a loss for the log,
    ``found_inf`` False, the gradient norm)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = tensors and not any(isinstance(t, FakeTensor) for t in tensors)
        if host and sum(t.numel() for t in tensors) <= HOST_ELEMENTS:
            with unset_fake_temporarily():
                return func(*args, **(kwargs or {}))
        if func is torch.ops.aten._local_scalar_dense.default:
            value = args[0]
            if isinstance(value, FakeTensor) and value.constant is None:
                return False if value.dtype == torch.bool else 0
        return func(*args, **(kwargs or {}))


class FusedRMSNorm(torch.autograd.Function):
    """RMSNorm as CUDA runs it: backward keeps the input, the weight and the fp32 ``rstd``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        normed, upstream = x.float() * rstd, grad.float()
        grad_weight = (upstream * normed).sum(dim=tuple(range(grad.dim() - 1)))
        scaled = upstream * weight.float()
        grad_x = rstd * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def fused_rms_norm_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    """``RMSNorm.forward`` (the engine's) through :class:`FusedRMSNorm`."""
    return FusedRMSNorm.apply(x, self.weight, self.eps or torch.finfo(x.dtype).eps)
