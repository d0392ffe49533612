"""Which device a setting such as ``device="auto"`` means, decided once for every package.

Training engines, rollouts and weight-sync transports all read a ``device`` setting; they
resolve it here so that ``auto`` picks the same accelerator on each side, an unknown device is
refused by name in one line, and a device that is absent here fails before anything is built.
torch is imported when a device is resolved (this package installs with the standard library
alone).
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from drivetrain.api.errors import ConfigError, DrivetrainError

if TYPE_CHECKING:
    import torch

#: Device type -> its collective backend. Anything else is refused by name, never a KeyError.
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def _npu_available() -> bool:
    import torch

    npu = getattr(torch, "npu", None)  # present once torch_npu is imported
    return bool(npu is not None and npu.is_available())


def _local_index(kind: str) -> int:
    """This process's accelerator: ``LOCAL_RANK`` (torchrun, Ray) modulo the visible count,
    else the current one (what an earlier ``set_device`` chose)."""
    import torch

    module = getattr(torch, kind)
    if "LOCAL_RANK" in os.environ:
        # Ray may expose one GPU per actor while LOCAL_RANK counts all local ranks
        return int(os.environ["LOCAL_RANK"]) % module.device_count()
    return module.current_device()


def resolve_device(
    requested: str,
    *,
    setting: str = "device",
    error: type[DrivetrainError] = ConfigError,
    kinds: Collection[str] = tuple(BACKENDS),
) -> torch.device:
    """``auto``: the local accelerator among ``kinds`` (CUDA, then Ascend NPU), else the CPU.
    Otherwise the named device (``cpu``, ``cuda``, ``cuda:1``, ``npu``, or another of
    ``kinds``), checked to be present here where torch can tell; an accelerator without an
    index gets this process's. ``kinds``: the device types the caller runs on (an engine
    without NPU support leaves it out; a rollout may add ``mps``). Errors name ``setting`` and
    are raised as ``error``, so each package keeps its own error type."""
    import torch

    if requested == "auto":
        if "cuda" in kinds and torch.cuda.is_available():
            return torch.device("cuda", _local_index("cuda"))
        if "npu" in kinds and _npu_available():
            return torch.device("npu", _local_index("npu"))
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError as exc:
        raise error(
            f"{setting}={requested!r} is not a device; use auto or one of {', '.join(kinds)}"
        ) from exc
    if device.type not in kinds:
        named = [f"{d} ({BACKENDS[d]})" if d in BACKENDS else d for d in kinds]
        raise error(
            f"{setting}={requested!r} is not supported: supported are auto, " + ", ".join(named)
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise error(f"{setting}={requested!r} but CUDA is not available here")
    if device.type == "npu" and not _npu_available():
        raise error(f"{setting}={requested!r} but no Ascend NPU is available (torch_npu)")
    if device.type in ("cuda", "npu") and device.index is None:
        device = torch.device(device.type, _local_index(device.type))
    return device
