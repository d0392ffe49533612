"""Where buckets live and which collective moves them, decided from the device."""

from __future__ import annotations

import torch

from drivetrain.api.weight_sync import WeightSyncError

#: Device type -> collective backend. Anything else is refused by name, never a KeyError.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _npu_available() -> bool:
    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    return bool(npu is not None and npu.is_available())


def resolve_device(requested: str) -> torch.device:
    """``auto``: the local accelerator (CUDA, then Ascend NPU), else the CPU. Otherwise the
    named device, checked to be one the transports support and present here."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available():
            return torch.device("npu", torch.npu.current_device())  # type: ignore[attr-defined]
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise WeightSyncError(
            f"weight_sync.device={requested!r} is not a device; use auto or one of "
            f"{sorted(BACKENDS)}"
        ) from exc
    if device.type not in BACKENDS:
        raise WeightSyncError(
            f"weight sync does not support device {requested!r}: supported are "
            + ", ".join(f"{d} ({b})" for d, b in BACKENDS.items())
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise WeightSyncError(f"weight_sync.device={requested!r} but CUDA is not available here")
    if device.type == "npu" and not _npu_available():
        raise WeightSyncError(
            f"weight_sync.device={requested!r} but no Ascend NPU is available (torch_npu)"
        )
    if device.type in ("cuda", "npu") and device.index is None:
        module = getattr(torch, device.type)
        device = torch.device(device.type, module.current_device())
    return device


def collective_backend(device: torch.device, override: str = "") -> str:
    """The process-group backend for ``device`` (or ``override``, checked against it)."""
    expected = BACKENDS.get(device.type)
    if expected is None:
        raise WeightSyncError(
            f"no collective backend for device {device.type!r}; supported: "
            + ", ".join(f"{d} ({b})" for d, b in BACKENDS.items())
        )
    if override and override != expected and not (override == "gloo" and device.type == "cpu"):
        raise WeightSyncError(
            f"backend {override!r} cannot move tensors on {device.type!r} (use {expected!r})"
        )
    return override or expected


def synchronize(device: torch.device) -> None:
    """Wait for queued copies on ``device`` (buckets are handed to another process or a
    collective that does not order itself after the copy stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)  # type: ignore[attr-defined]
