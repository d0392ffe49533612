"""Two bucket buffers one process creates and others map: POSIX shared memory on the CPU,
CUDA IPC handles on a GPU."""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Mapping
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch

from drivetrain.api.weight_sync import WeightSyncError


class _Mapping:
    """A receiver's view of a segment the sender created: mapped from ``/dev/shm`` directly,
    so no resource tracker (Python < 3.13 registers attached segments and would unlink them
    at exit, or un-register the sender's own when both share a tracker) ever touches it."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name.lstrip('/')}", os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.name = name

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        raise RuntimeError("only the sender unlinks its segments")


class SharedMemoryBuffers:
    """Named shared-memory segments viewed as ``uint8`` tensors."""

    kind = "shm"

    def __init__(self, segments: list[Any], size: int) -> None:
        self.segments = segments
        self.buffers = [
            torch.frombuffer(seg.buf, dtype=torch.uint8, count=size) for seg in segments
        ]

    @classmethod
    def create(cls, size: int) -> SharedMemoryBuffers:
        segments: list[shared_memory.SharedMemory] = []
        try:
            for _ in (0, 1):
                segments.append(shared_memory.SharedMemory(create=True, size=size))
                # reserve the pages now: tmpfs only promises them, and a full /dev/shm would
                # otherwise kill the first pack with SIGBUS instead of raising here
                os.posix_fallocate(segments[-1]._fd, 0, size)  # type: ignore[attr-defined]
        except OSError as exc:
            for seg in segments:
                seg.close()
                seg.unlink()
            raise WeightSyncError(
                f"cannot allocate 2 x {size} bytes of shared memory ({exc}); lower "
                "weight_sync.bucket_bytes or enlarge /dev/shm"
            ) from exc
        return cls(segments, size)

    @classmethod
    def attach(cls, endpoint: Mapping[str, Any]) -> SharedMemoryBuffers:
        segments: list[Any] = []
        for name in endpoint["segments"]:
            if os.path.isdir("/dev/shm"):
                segments.append(_Mapping(name))
                continue
            seg = shared_memory.SharedMemory(name=name)  # other POSIX systems
            with contextlib.suppress(Exception):
                resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
            segments.append(seg)
        return cls(segments, int(endpoint["bucket_bytes"]))

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
            with contextlib.suppress(BufferError):
                seg.close()
            if owner:
                with contextlib.suppress(FileNotFoundError):
                    seg.unlink()
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
