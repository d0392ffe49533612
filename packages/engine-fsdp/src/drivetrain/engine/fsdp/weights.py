"""Streaming the sharded model out as Hugging Face named full tensors, and HF export.

FSDP2: parameters are DTensors; each is gathered on its own (``full_tensor``), yielded, then
dropped. FSDP1: one wrapped unit (a decoder layer, or the root's own parameters) is gathered at
a time with ``summon_full_params``. LoRA: merged weights (``W + B A * alpha/r``), or the
adapters alone under peft's names.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from drivetrain.api import NamedTensor

_PREFIXES = ("hf.", "base_model.model.")
_FSDP1_MARKER = "_fsdp_wrapped_module."


def _clean(name: str) -> str:
    name = name.replace(_FSDP1_MARKER, "")
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _named_full_fsdp2(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in model.named_parameters():
        yield _clean(name), _full(param.detach())


def _named_full_fsdp1(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = FSDP.fsdp_modules(model)  # root first, then nested units in module order
    nested = {id(p) for unit in units[1:] for p in unit.parameters()}
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    prefixes = {id(m): f"{name}." if name else "" for name, m in model.named_modules()}
    for index, unit in enumerate(units):
        with FSDP.summon_full_params(unit, recurse=False, writeback=False):
            owned = [
                (name, p) for name, p in unit.named_parameters() if index > 0 or id(p) not in nested
            ]
            owned.sort(key=lambda item: order.get(id(item[1]), 0))
            for name, param in owned:
                yield _clean(prefixes[id(unit)] + name), param.detach().clone()


_LORA_PARTS = {".base_layer.": "base", ".lora_A.": "A", ".lora_B.": "B"}


def _lora_part(name: str) -> tuple[str, str, str] | None:
    """``"x.q_proj.lora_B.default.weight"`` -> ``("x.q_proj", "B", "weight")``."""
    for marker, part in _LORA_PARTS.items():
        if marker in name:
            module, _, rest = name.partition(marker)
            return module, part, rest.rsplit(".", 1)[-1]
    return None


def _lora_merged(
    stream: Iterator[tuple[str, torch.Tensor]], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fold each LoRA linear's ``base_layer`` weight (and bias), ``lora_A`` and ``lora_B`` into
    plain ``weight``/``bias``. Parameters arrive in module order (base, A, B), so at most one
    module's tensors are held at a time."""
    pending: dict[str, dict[tuple[str, str], torch.Tensor]] = {}
    for name, tensor in stream:
        part = _lora_part(name)
        if part is None:
            yield name, tensor
            continue
        module, kind, suffix = part
        group = pending.setdefault(module, {})
        group[(kind, suffix)] = tensor
        if ("A", "weight") in group and ("B", "weight") in group:
            base = group[("base", "weight")]
            delta = group[("B", "weight")].float() @ group[("A", "weight")].float()
            yield f"{module}.weight", base + (delta * scaling).to(base.dtype)
            if ("base", "bias") in group:
                yield f"{module}.bias", group[("base", "bias")]
            del pending[module]


def export_stream(
    model: nn.Module,
    *,
    fsdp1: bool,
    dtype: torch.dtype,
    lora_scaling: float | None,
    adapter_only: bool,
) -> Iterator[NamedTensor]:
    """HF-named full tensors in ``dtype``, one at a time (see the module docstring)."""
    raw = _named_full_fsdp1(model) if fsdp1 else _named_full_fsdp2(model)
    # peft keeps a frozen copy of fully trained modules (a critic's value head): skip it
    raw = ((n, t) for n, t in raw if ".original_module." not in n)
    if lora_scaling is not None and adapter_only:
        for name, tensor in raw:
            part = _lora_part(name)
            if part is not None and part[1] != "base":
                module, kind, suffix = part
                yield f"base_model.model.{module}.lora_{kind}.{suffix}", tensor.to(dtype)
            elif ".modules_to_save.default." in name:  # fully trained modules (a value head)
                plain = name.replace(".modules_to_save.default", "")
                yield f"base_model.model.{plain}", tensor.to(dtype)
        return
    stream = _lora_merged(raw, lora_scaling) if lora_scaling is not None else raw
    for name, tensor in stream:
        yield name.replace(".modules_to_save.default", ""), tensor.to(dtype)
