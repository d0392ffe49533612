"""Two bucket buffers one process creates and others map: POSIX shared memory on the CPU,
CUDA IPC handles on a GPU."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.ckpt import shm_segments
from drivetrain.ckpt.shm_segments import Segment


class SharedMemoryBuffers:
    """Named shared-memory segments viewed as ``uint8`` tensors (see :mod:`shm_segments` for
    how they are named, unlinked and reaped)."""

    kind = "shm"

    def __init__(self, segments: list[Segment], size: int) -> None:
        self.segments = segments
        self.buffers = [
            torch.frombuffer(seg.buf, dtype=torch.uint8, count=size) for seg in segments
        ]

    @classmethod
    def create(cls, size: int) -> SharedMemoryBuffers:
        shm_segments.reap_orphans()  # what killed senders left, before adding our own
        try:
            return cls(shm_segments.create_owned(size, 2), size)
        except OSError as exc:
            raise WeightSyncError(
                f"cannot allocate 2 x {size} bytes of shared memory ({exc}); lower "
                "weight_sync.bucket_bytes or enlarge /dev/shm"
            ) from exc

    @classmethod
    def attach(cls, endpoint: Mapping[str, Any]) -> SharedMemoryBuffers:
        return cls([Segment(name) for name in endpoint["segments"]], int(endpoint["bucket_bytes"]))

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "segments": [seg.name for seg in self.segments],
            "bucket_bytes": self.buffers[0].numel(),
        }

    def handles(self) -> Any:
        return None  # receivers find the segments by name

    def close(self, *, owner: bool) -> None:
        self.buffers = []  # tensors export the mapping; drop them before closing it
        for seg in self.segments:
            seg.close()
            if owner:
                shm_segments.unlink(seg.name)
        self.segments = []


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaIpcBuffers:
    """CUDA allocations of the sender, opened by receivers on the same physical GPU through IPC
    handles (the device is matched by UUID, whatever ``CUDA_VISIBLE_DEVICES`` each sees)."""

    kind = "cuda_ipc"

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers

    @classmethod
    def create(cls, size: int, device: torch.device) -> CudaIpcBuffers:
        return cls([torch.empty(size, dtype=torch.uint8, device=device) for _ in (0, 1)])

    def describe(self) -> dict[str, Any]:
        index = self.buffers[0].device.index
        return {
            "kind": self.kind,
            "device_uuid": _device_uuid(index),
            "bucket_bytes": self.buffers[0].numel(),
        }

    def handles(self) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        return [reduce_tensor(buffer) for buffer in self.buffers]

    @classmethod
    def attach(cls, endpoint: Mapping[str, Any], handles: Any) -> CudaIpcBuffers:
        if not torch.cuda.is_available():
            raise WeightSyncError("colocated CUDA IPC needs CUDA in the receiving process")
        wanted = endpoint["device_uuid"]
        local = [i for i in range(torch.cuda.device_count()) if _device_uuid(i) == wanted]
        if not local:
            raise WeightSyncError(
                f"the sender's GPU {wanted} is not visible here: colocated sync needs both "
                "processes on the same GPU (use broadcast across GPUs)"
            )
        buffers = []
        for rebuild, args in handles:
            args = list(args)
            args[6] = local[0]  # storage device: the sender's index may differ from ours
            buffers.append(rebuild(*args))
        return cls(buffers)

    def close(self, *, owner: bool) -> None:
        self.buffers = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
