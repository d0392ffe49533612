"""Where buckets live and which collective moves them, decided from the device."""

from __future__ import annotations

import torch

from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.runtime.devices import BACKENDS, resolve_device


def bucket_device(requested: str) -> torch.device:
    """Where buckets live: ``weight_sync.device`` resolved as every package resolves a device,
    refused as a :class:`WeightSyncError`."""
    return resolve_device(requested, setting="weight_sync.device", error=WeightSyncError)


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
