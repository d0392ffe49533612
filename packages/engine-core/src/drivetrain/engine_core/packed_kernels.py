"""Packed attention in one kernel call per layer, whatever the number of documents.

On a GPU the grouped SDPA path (:mod:`drivetrain.engine_core.packed_attention`) makes one call per
group of similar-length documents and pads each group: on the first H100 run packed documents
reached 0.60 of the dense MFU (0.96 on the CPU, where that path was tuned). A variable-length
kernel takes the whole row at once, with the documents' offsets (``cu_seqlens``), and computes
only the scores inside each document:

- ``flash_attn``: flash-attn's ``flash_attn_varlen_func`` (CUDA, when the package is installed);
- ``torch_varlen``: PyTorch's own ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.10,
  flash kernels shipped with torch);
- ``grouped_sdpa``: the grouped SDPA path (any device; the fastest measured on the CPU).

``auto`` picks the first of these the device and the installation allow. A span with a shared
prefix (GRPO's n samples of one prompt) attends to the prefix's keys and then causally to its
own: its keys are gathered as ``[prefix, own]`` (one gather per forward, reused by every layer)
and the kernels' causal mask, aligned bottom-right when a span has more keys than queries, is
exactly that rule.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from drivetrain.engine_core.packed_attention import Span

#: what an engine's ``packed_kernel`` may name; ``auto`` chooses by device and installation
PACKED_KERNELS = ("auto", "flash_attn", "torch_varlen", "grouped_sdpa")


class VarlenKernel(Protocol):
    """Causal attention over documents packed in ``[T, heads, dim]`` tensors: queries of
    document ``i`` are rows ``cu_q[i]:cu_q[i+1]``, its keys ``cu_k[i]:cu_k[i+1]``; with more
    keys than queries, query ``j`` sees keys up to ``j + keys - queries`` (bottom-right)."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
        cu_k: torch.Tensor, max_q: int, max_k: int, scale: float | None, dropout: float,
    ) -> torch.Tensor: ...  # fmt: skip


def _flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float | None, dropout: float,
) -> torch.Tensor:  # fmt: skip
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout, softmax_scale=scale, causal=True
    )


def _torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
    max_q: int, max_k: int, scale: float | None, dropout: float,
) -> torch.Tensor:  # fmt: skip
    from torch.nn.attention.varlen import varlen_attn

    if dropout:
        raise RuntimeError("packed_kernel='torch_varlen' has no attention dropout")
    takes = inspect.signature(varlen_attn).parameters
    # torch 2.10 said is_causal=True; later releases say window_size=(-1, 0)
    options: dict[str, object] = (
        {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    )
    if scale is not None and "scale" in takes:
        options["scale"] = scale
    elif scale is not None:  # no scale argument: the default is 1/sqrt(dim); scale q instead
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)


#: the variable-length kernels by name (tests add a CPU reference under their own name)
VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "flash_attn": _flash_attn,
    "torch_varlen": _torch_varlen,
}


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


#: the kernels that need CUDA (a kernel registered under another name runs where it is)
CUDA_KERNELS = ("flash_attn", "torch_varlen")


def installed_kernels(device_type: str, dtype: str = "bfloat16") -> tuple[str, ...]:
    """The kernels this installation can run on ``device_type`` for a model computing in
    ``dtype``, best first (the flash kernels take float16 and bfloat16 only)."""
    found = []
    if device_type == "cuda" and dtype in ("float16", "bfloat16"):
        if _has("flash_attn"):
            found.append("flash_attn")
        if _has("torch.nn.attention.varlen"):
            found.append("torch_varlen")
    registered = [name for name in VARLEN_KERNELS if name not in CUDA_KERNELS]
    return (*found, "grouped_sdpa", *registered)


def choose_kernel(requested: str, device_type: str, installed: Sequence[str]) -> str:
    """``requested`` if it can run here, the best of ``installed`` for ``auto``; a kernel that
    cannot run here is a one-line error."""
    if requested not in PACKED_KERNELS and requested not in VARLEN_KERNELS:
        raise ValueError(f"packed_kernel={requested!r} is not one of {', '.join(PACKED_KERNELS)}")
    if requested == "auto":
        return installed[0]
    if requested not in installed:
        why = (
            "needs a CUDA device"
            if device_type != "cuda"
            else "is not installed or does not take this model dtype (float16/bfloat16 only)"
        )
        raise ValueError(
            f"packed_kernel={requested!r} {why} (this engine runs on {device_type}; "
            f"available: {', '.join(installed)})"
        )
    return requested


def engine_kernel(requested: str, device_type: str, dtype: str, *, say: bool) -> str:
    """What an engine's ``packed_kernel`` option resolves to here (a ``ConfigError`` in one
    line when it cannot run), announced once when ``say`` (the writing rank)."""
    from drivetrain.api import ConfigError

    try:
        kernel = choose_kernel(requested, device_type, installed_kernels(device_type, dtype))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if say:
        announce(kernel, device_type)
    return kernel


_announced: set[str] = set()


def announce(kernel: str, device_type: str) -> None:
    """Say once per process which kernel packed attention runs on."""
    if kernel not in _announced:
        _announced.add(kernel)
        print(f"packed attention on {device_type}: {kernel}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class VarlenLayout:
    """A packed row's spans as a variable-length kernel reads them."""

    cu_q: torch.Tensor  # [spans + 1] int32: query offsets (the spans in row order)
    cu_k: torch.Tensor  # [spans + 1] int32: key offsets in the gathered keys
    max_q: int
    max_k: int
    key_index: torch.Tensor | None  # [keys]: row position of each gathered key (None: the row)


def varlen_layout(spans: Sequence[Span], device: torch.device) -> VarlenLayout:
    """The layout of ``spans`` (in row order, covering every position once)."""
    spans = [s for s in spans if s.length > 0]
    index = None
    if any(s.prefix_len for s in spans):  # each span's keys: [its prefix, its own positions]
        ranges = (
            (
                range(s.prefix_start, s.prefix_start + s.prefix_len),
                range(s.start, s.start + s.length),
            )
            for s in spans
        )
        index = torch.tensor(
            list(itertools.chain.from_iterable(itertools.chain(*r) for r in ranges)),
            dtype=torch.long,
            device=device,
        )
    queries = [s.length for s in spans]
    keys = [s.keys for s in spans]

    def offsets(lengths: list[int]) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    return VarlenLayout(offsets(queries), offsets(keys), max(queries), max(keys), index)


def attend_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: VarlenLayout,
    kernel: Callable[..., torch.Tensor],
    dropout: float,
    scale: float | None,
) -> torch.Tensor:
    """``[1, h, T, d]`` in and out, one ``kernel`` call (keys and values with as many heads as
    the queries)."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, h, d] views
    if layout.key_index is not None:
        k, v = k[layout.key_index], v[layout.key_index]
    out = kernel(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        layout.cu_q,
        layout.cu_k,
        layout.max_q,
        layout.max_k,
        scale,
        dropout,
    )
    return out.transpose(0, 1).unsqueeze(0)
