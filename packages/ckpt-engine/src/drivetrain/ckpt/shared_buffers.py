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

    def handles(self) -> list[dict[str, Any]]:
        """Each buffer's IPC handle as plain data. torch's own reduction is a callable plus
        arguments meant for pickle; the receiver calls the one rebuild function itself, so
        nothing read from the channel names code to run."""
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for buffer in self.buffers:
            _rebuild, args = reduce_tensor(buffer)
            (_cls, size, stride, offset, _storage_cls, dtype, _device, handle, size_bytes,
             offset_bytes, _grad, ref_handle, ref_offset, event, event_sync) = args  # fmt: skip
            out.append({
                "size": list(size), "stride": list(stride), "offset": int(offset),
                "dtype": str(dtype).removeprefix("torch."), "handle": bytes(handle),
                "size_bytes": int(size_bytes), "offset_bytes": int(offset_bytes),
                "ref_counter_handle": bytes(ref_handle), "ref_counter_offset": int(ref_offset),
                "event_handle": None if event is None else bytes(event),
                "event_sync_required": bool(event_sync),
            })  # fmt: skip
        return out

    @classmethod
    def attach(cls, endpoint: Mapping[str, Any], handles: list[dict[str, Any]]) -> CudaIpcBuffers:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

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
        for h in handles:
            if h["dtype"] != "uint8":
                raise WeightSyncError(f"a bucket buffer of dtype {h['dtype']!r}, not uint8")
            buffers.append(rebuild_cuda_tensor(
                torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"],
                torch.storage.TypedStorage, torch.uint8,
                local[0],  # storage device: the sender's index may differ from ours
                h["handle"], h["size_bytes"], h["offset_bytes"], False,
                h["ref_counter_handle"], h["ref_counter_offset"], h["event_handle"],
                h["event_sync_required"],
            ))  # fmt: skip
        return cls(buffers)

    def close(self, *, owner: bool) -> None:
        self.buffers = []
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
