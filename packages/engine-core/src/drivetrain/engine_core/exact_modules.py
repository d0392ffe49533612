"""A transformers model whose every token gets the same bits in any batch, cache or packing.

What differs between a rollout's forward and a trainer's for the same token, measured on the
CPU (this machine's MKL and oneDNN, see the trainer README's exact-mode section):

- ``F.linear`` in float32 gives a row other bits when the call has 1-3 rows (MKL's small-``M``
  path; with two threads, each thread's share of the rows counts: 5-7 and 9-11 rows differ
  too), when the rows are a strided view, or when the bias is added inside the product. With
  a multiple of 4 contiguous rows and the bias added after, a row's bits depend on nothing
  else, at 1, 2, 4 or 8 threads alike (measured up to K=2048, N=8192). :func:`exact_linear` pads
  a call's rows to a multiple of :data:`ROW_MULTIPLE` and adds the bias after.
- SiLU (and sigmoid) compute the last elements of a buffer with the scalar formula instead of
  the vectorised one: the same value gets other bits depending on where it sits. ``exp``,
  division and addition do not: :class:`ExactSiLU` is built from them.
- The rotary tables are computed from the positions of the call; here once for every position,
  then looked up.
- Attention: :mod:`drivetrain.engine_core.exact_attention`.

RMSNorm, the embedding, softmax and log-softmax were measured row-invariant as they are.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: a linear call's rows are padded to a multiple of this (MKL's row-invariant shapes)
ROW_MULTIPLE = 4
#: rotary types whose tables depend on the position alone (dynamic ones rescale per call)
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def exact_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` whose rows do not depend on how many rows the call has, the thread count,
    or the input's strides (a strided view, such as each prompt's last position, is copied)."""
    rows = x.numel() // max(1, x.shape[-1])
    extra = -rows % ROW_MULTIPLE
    if not extra:
        out = F.linear(x.contiguous(), weight)
    else:
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(extra, flat.shape[-1])])
        out = F.linear(padded, weight)[:rows].reshape(*x.shape[:-1], weight.shape[0])
    # the bias is added apart: inside the product (addmm) where it enters the sum depends on M
    return out if bias is None else out + bias


class ExactSiLU(nn.Module):
    """``x * sigmoid(x)`` as ``x / (1 + exp(-x))`` in float32: the same bits wherever ``x``
    sits in its tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        return (wide / (1.0 + torch.exp(-wide))).to(x.dtype)


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return exact_linear(x, self.weight, self.bias)


def make_exact(model: nn.Module) -> nn.Module:
    """Switch ``model``'s linears, SiLU activations and rotary tables to their batch-invariant
    forms, in place (attention is the caller's: it registers its implementation). A module
    with no batch-invariant form here (another activation, a layer norm, a fused or
    ``nn.Linear``-derived layer, a rotary type that rescales per call) is a one-line
    ``ValueError`` naming it: refused, never left inexact."""
    for name, module in list(model.named_modules()):
        _check_supported(module, name)
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_linear_forward, module)
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.SiLU) or type(child).__name__ == "SiLUActivation":
                setattr(module, child_name, ExactSiLU())
        if type(module).__name__.endswith("RotaryEmbedding"):
            _table_rotary(module, name)
    return model


#: modules with their own parameters that are exact as they are or made so here
_PARAMETERISED = (nn.Linear, nn.Embedding)
#: activations that are exact elementwise (no transcendental function), or replaced
_ACTIVATIONS_OK = (nn.SiLU, nn.ReLU, nn.Identity)


def _check_supported(module: nn.Module, name: str) -> None:
    kind = type(module)
    own = next(module.parameters(recurse=False), None) is not None
    norm = kind.__name__.endswith("RMSNorm")
    if own and not (kind in _PARAMETERISED or norm):
        raise ValueError(
            f"numerics=exact has no batch-invariant form of {kind.__name__} ({name}): "
            "it covers Linear, Embedding and RMSNorm layers"
        )
    activation = kind.__module__.startswith("torch.nn.modules.activation") or (
        kind.__name__.endswith(("Activation", "GELU", "GELUTanh"))
    )
    if activation and kind.__name__ != "SiLUActivation" and not issubclass(kind, _ACTIVATIONS_OK):
        raise ValueError(
            f"numerics=exact has no batch-invariant form of the activation {kind.__name__} "
            f"({name}): it covers SiLU and ReLU"
        )


def _table_rotary(module: nn.Module, name: str) -> None:
    rope = getattr(module, "rope_type", "default")
    if rope not in STATIC_ROPE:
        raise ValueError(
            f"numerics=exact: {name or 'the model'} uses rotary type {rope!r}, which rescales "
            f"per call; exact mode takes {', '.join(STATIC_ROPE)}"
        )
    computed = module.forward
    tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    limits = ("max_seq_len_cached", "original_max_seq_len")
    longest = max(int(getattr(module, attr, 0) or 0) for attr in limits)
    if longest < 1:
        raise ValueError(f"numerics=exact: {name or 'the model'}'s rotary has no position limit")

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        if x.device not in tables:
            every = torch.arange(longest, device=x.device)[None]
            with torch.no_grad():
                cos, sin = computed(torch.zeros(1, device=x.device), every)
            tables[x.device] = (cos[0], sin[0])
        if int(position_ids.max()) >= longest:
            raise RuntimeError(f"position {int(position_ids.max())} is past the model's {longest}")
        cos, sin = tables[x.device]
        return cos[position_ids].to(x.dtype), sin[position_ids].to(x.dtype)

    module.forward = forward
