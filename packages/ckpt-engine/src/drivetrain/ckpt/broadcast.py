"""``broadcast``: one trainer rank broadcasts bucket after bucket to every rollout worker over
a process group of their own (NCCL on CUDA, HCCL on Ascend, gloo on CPU).

Per bucket the sender broadcasts a fixed header ``[kind, meta_len, data_len, index]``, then the
bucket's metadata (JSON), then the bucket's bytes, all asynchronously: the next bucket is packed
into the other buffer while this one is on the wire. After the last bucket every participant
joins one all-reduce that carries each receiver's verdict, so ``send`` returns only once every
receiver holds and has checked the whole stream, and fails if one did not.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any

import torch

from drivetrain.api.weight_sync import (
    Topology,
    TransportRole,
    WeightSyncError,
)
from drivetrain.ckpt import groups
from drivetrain.ckpt.bucket_transport import BucketTransport
from drivetrain.ckpt.config import BroadcastConfig
from drivetrain.ckpt.devices import collective_backend, resolve_device

BUCKET, END, ABORT = 1, 2, 3


def _meta_tensor(meta: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    raw = json.dumps(meta).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


class _Link:
    """What both ends of one sync read from the connected transport."""

    def __init__(self, transport: BroadcastTransport) -> None:
        self.group = transport.group
        self.buffers = transport.buffers
        self.device = transport.device
        self.root = transport.root
        self.timeout = transport.config.timeout_s


class _Sender(_Link):
    def __init__(self, transport: BroadcastTransport) -> None:
        super().__init__(transport)
        self._pending: dict[int, list[Any]] = {}
        self._keep: dict[int, list[torch.Tensor]] = {}
        self.broken = False

    def _announce(self, kind: int, meta: Mapping[str, Any], data_len: int, index: int) -> list:
        body = _meta_tensor(meta, self.device)
        head = torch.tensor([kind, body.numel(), data_len, index], dtype=torch.int64)
        head = head.to(self.device)
        works = [groups.broadcast(self.group, t, self.root) for t in (head, body)]
        self._keep[index] = [head, body]
        return works

    def _wait_all(self, works: list[Any]) -> None:
        try:
            for work in works:
                groups.wait(work, self.timeout)
        except Exception as exc:
            self.broken = True
            raise WeightSyncError(
                f"broadcast failed (a receiver died or timed out): {exc}"
            ) from exc

    def post(self, index: int, header: dict[str, Any]) -> None:
        works = self._announce(BUCKET, header, header["nbytes"], index)
        data = self.buffers[index][: header["nbytes"]]
        works.append(groups.broadcast(self.group, data, self.root))
        self._pending[index] = works

    def wait(self, index: int) -> None:
        self._wait_all(self._pending.pop(index, []))

    def finish(self, summary: dict[str, Any]) -> None:
        self._wait_all(self._announce(END, summary, 0, -1))
        verdict = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            groups.all_reduce_max(self.group, verdict, self.timeout)
        except Exception as exc:
            self.broken = True
            raise WeightSyncError(f"a receiver did not confirm the stream: {exc}") from exc
        if int(verdict.item()) != 0:
            raise WeightSyncError("a receiver rejected the stream (its log says why)")

    def abort(self, reason: str) -> None:
        if self.broken:
            return  # the group is unusable; the transport aborts it so peers fail fast
        try:
            self._wait_all(list(self._pending.pop(0, [])) + list(self._pending.pop(1, [])))
            self._wait_all(self._announce(ABORT, {"reason": reason}, 0, -1))
        except WeightSyncError:
            self.broken = True


class _Receiver(_Link):
    def __init__(self, transport: BroadcastTransport) -> None:
        super().__init__(transport)
        self._free = [threading.Semaphore(1), threading.Semaphore(1)]
        self._index = 0

    def _receive(self, tensor: torch.Tensor) -> None:
        try:
            groups.wait(groups.broadcast(self.group, tensor, self.root), self.timeout)
        except Exception as exc:
            raise WeightSyncError(f"broadcast from the sender failed: {exc}") from exc

    def next(self) -> tuple[str, dict[str, Any], int]:
        head = torch.zeros(4, dtype=torch.int64, device=self.device)
        self._receive(head)
        kind, meta_len, data_len, _ = (int(v) for v in head.tolist())
        body = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
        self._receive(body)
        meta = json.loads(bytes(body.cpu().numpy()))
        if kind == ABORT:
            raise WeightSyncError(f"the sender aborted the sync: {meta['reason']}")
        if kind == END:
            return "end", meta, -1
        if kind != BUCKET or data_len > self.buffers[0].numel():
            raise WeightSyncError(f"malformed bucket header {head.tolist()}")
        index = self._index
        self._free[index].acquire()
        self._receive(self.buffers[index][:data_len])
        self._index ^= 1
        return "bucket", meta, index

    def release(self, index: int) -> None:
        self._free[index].release()

    def close(self) -> None:
        """The consumer left early: never leave the reader waiting for a free buffer."""
        for free in self._free:
            free.release()

    def confirm(self, ok: bool, detail: str) -> None:
        verdict = torch.tensor([0 if ok else 1], dtype=torch.int64).to(self.device)
        try:
            groups.all_reduce_max(self.group, verdict, self.timeout)
        except Exception as exc:
            raise WeightSyncError(f"confirming the stream to the sender failed: {exc}") from exc


class BroadcastTransport(BucketTransport):
    config: BroadcastConfig

    def __init__(self, config: BroadcastConfig) -> None:
        super().__init__(config)
        self._store: Any = None
        self.group: Any = None
        self.buffers: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        self.role: TransportRole | None = None
        self.root = 0

    def prepare(self) -> Mapping[str, Any]:
        self.finalize()  # a second prepare (reconnecting) must not leak the first's group
        device = resolve_device(self.config.device)
        backend = collective_backend(device, self.config.backend)
        self._store = groups.master_store(self.config.host, self.config.port, self.config.timeout_s)
        return {
            "host": self.config.host,
            "port": self._store.port,
            "backend": backend,
            "bucket_bytes": self.config.bucket_bytes,
        }

    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        if len(topology.senders) != 1:
            raise WeightSyncError(f"broadcast has exactly one sender, got {topology.senders}")
        mine = topology.senders if role is TransportRole.SENDER else topology.receivers
        if rank not in mine:
            raise WeightSyncError(f"rank {rank} is not a {role.value} in {topology}")
        self.device = resolve_device(self.config.device)
        backend = collective_backend(self.device, self.config.backend)
        if backend != endpoint["backend"]:
            raise WeightSyncError(
                f"the sender broadcasts with {endpoint['backend']}, but this {role.value}'s "
                f"device {self.device} needs {backend}: put both ends on the same device type"
            )
        timeout = self.config.timeout_s
        if role is TransportRole.SENDER:
            if self._store is None:
                raise WeightSyncError("the sender must call prepare() before connect()")
            store = self._store
        else:
            store = groups.client_store(endpoint["host"], endpoint["port"], timeout)
            self._store = store
        self.group = groups.new_group(backend, store, rank, topology.world_size, timeout)
        self.root = topology.senders[0]
        try:  # everyone joined: the first sync does not pay for connection setup
            zero = torch.zeros(1, dtype=torch.int64).to(self.device)
            groups.all_reduce_max(self.group, zero, timeout)
        except Exception as exc:
            raise WeightSyncError(f"joining the weight-sync group failed: {exc}") from exc
        size = int(endpoint["bucket_bytes"])  # the sender's size, whatever ours says
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in (0, 1)]
        self.role = role

    def _require(self, role: TransportRole) -> None:
        if self.group is None:
            raise WeightSyncError("not connected (connect() first, or after a failed sync)")
        if self.role is not role:
            raise WeightSyncError(f"this transport connected as {self.role}, not {role.value}")

    def _sender_link(self) -> _Sender:
        self._require(TransportRole.SENDER)
        return _Sender(self)

    def _receiver_link(self) -> _Receiver:
        self._require(TransportRole.RECEIVER)
        return _Receiver(self)

    def _on_broken(self) -> None:
        """A failed collective leaves the group unusable: abort it so the other peers stop
        waiting, and require a new connect()."""
        groups.shut_down(self.group, abort=True)
        self.group = None

    def finalize(self) -> None:
        if self.group is not None:
            groups.shut_down(self.group, abort=False)
        self.group = None
        self.buffers = []
        self._store = None
        self.role = None
