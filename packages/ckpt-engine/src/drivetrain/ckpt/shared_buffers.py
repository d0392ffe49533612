"""Two bucket buffers one process creates and others map: POSIX shared memory on the CPU,
CUDA IPC handles on a GPU; and how each side orders its writes and reads of them.

The four ordering calls follow a buffer's round: the sender ``packed`` it, each receiver
finds it ``arrived``, reads it and says it ``consumed`` it, and the sender, told so over the
channel, makes it ``reusable``. In host memory a copy is done when it returns, so they do
nothing. On a GPU they are interprocess CUDA events, recorded and waited on by the streams:
no host ever waits for the device in a sync's loop, so planning the next bucket overlaps the
copies of the last. A stream waits on an event's latest record when the wait is queued: each
side records before it sends the message the other side waits for, so it waits on this round's
record, never an older one.
"""

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

    def peer_handles(self) -> Any:
        return None  # a receiver's reads are done when its copies return

    def add_peer(self, rank: int, handles: Any) -> None:
        pass

    def packed(self, index: int) -> None:
        pass

    def reusable(self, index: int) -> None:
        pass

    def arrived(self, index: int) -> None:
        pass

    def consumed(self, index: int) -> None:
        pass

    def close(self, *, owner: bool) -> None:
        self.buffers = []  # tensors export the mapping; drop them before closing it
        for seg in self.segments:
            seg.close()
            if owner:
                shm_segments.unlink(seg.name)
        self.segments = []


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _shared_events(device: torch.device) -> list[torch.cuda.Event]:
    """One interprocess event per buffer, made on ``device`` (an event takes the current
    device when its handle is first asked for)."""
    with torch.cuda.device(device):
        events = [torch.cuda.Event(interprocess=True) for _ in (0, 1)]
        for event in events:
            event.ipc_handle()
    return events


def _opened_events(device: torch.device, handles: Any) -> list[torch.cuda.Event]:
    if not (
        isinstance(handles, list)
        and len(handles) == 2
        and all(isinstance(handle, bytes) for handle in handles)
    ):
        raise WeightSyncError(f"expected two CUDA event handles, got {handles!r:.80}")
    return [torch.cuda.Event.from_ipc_handle(device, handle) for handle in handles]


class CudaIpcBuffers:
    """CUDA allocations of the sender, opened by receivers on the same physical GPU through IPC
    handles (the device is matched by UUID, whatever ``CUDA_VISIBLE_DEVICES`` each sees)."""

    kind = "cuda_ipc"

    def __init__(
        self,
        buffers: list[torch.Tensor],
        written: list[torch.cuda.Event],
        read: list[torch.cuda.Event] | None = None,
    ) -> None:
        self.buffers = buffers
        self.device = buffers[0].device
        #: buffer -> the event the sender records once its bytes are queued
        self.written = written
        #: a receiver's own: buffer -> the event it records once its reads are queued
        self.read = read or []
        #: the sender's: each receiver's ``read`` events, opened here
        self.peers: dict[int, list[torch.cuda.Event]] = {}

    @classmethod
    def create(cls, size: int, device: torch.device) -> CudaIpcBuffers:
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in (0, 1)]
        return cls(buffers, _shared_events(device))

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
            (
                _cls,
                size,
                stride,
                offset,
                _storage_cls,
                dtype,
                _device,
                handle,
                size_bytes,
                offset_bytes,
                _grad,
                ref_handle,
                ref_offset,
                event,
                event_sync,
            ) = args
            out.append(
                {
                    "size": list(size),
                    "stride": list(stride),
                    "offset": int(offset),
                    "dtype": str(dtype).removeprefix("torch."),
                    "handle": bytes(handle),
                    "size_bytes": int(size_bytes),
                    "offset_bytes": int(offset_bytes),
                    "ref_counter_handle": bytes(ref_handle),
                    "ref_counter_offset": int(ref_offset),
                    "event_handle": None if event is None else bytes(event),
                    "event_sync_required": bool(event_sync),
                    "written_event": bytes(self.written[len(out)].ipc_handle()),
                }
            )
        return out

    def peer_handles(self) -> list[bytes]:
        """A receiver's own events, for the sender to open (:meth:`add_peer`)."""
        return [bytes(event.ipc_handle()) for event in self.read]

    def add_peer(self, rank: int, handles: Any) -> None:
        self.peers[rank] = _opened_events(self.device, handles)

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def packed(self, index: int) -> None:
        self.written[index].record(self._stream())

    def reusable(self, index: int) -> None:
        stream = self._stream()
        for events in self.peers.values():
            events[index].wait(stream)

    def arrived(self, index: int) -> None:
        self.written[index].wait(self._stream())

    def consumed(self, index: int) -> None:
        self.read[index].record(self._stream())

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
        buffers, written = [], []
        for h in handles:
            if h["dtype"] != "uint8":
                raise WeightSyncError(f"a bucket buffer of dtype {h['dtype']!r}, not uint8")
            buffers.append(
                rebuild_cuda_tensor(
                    torch.Tensor,
                    torch.Size(h["size"]),
                    tuple(h["stride"]),
                    h["offset"],
                    torch.storage.TypedStorage,
                    torch.uint8,
                    local[0],  # storage device: the sender's index may differ from ours
                    h["handle"],
                    h["size_bytes"],
                    h["offset_bytes"],
                    False,
                    h["ref_counter_handle"],
                    h["ref_counter_offset"],
                    h["event_handle"],
                    h["event_sync_required"],
                )
            )
            written.append(h["written_event"])
        device = torch.device("cuda", local[0])
        return cls(buffers, _opened_events(device, written), _shared_events(device))

    def close(self, *, owner: bool) -> None:
        self.buffers, self.written, self.read, self.peers = [], [], [], {}
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
