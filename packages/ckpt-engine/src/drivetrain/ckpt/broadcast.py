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
from drivetrain.ckpt.devices import bucket_device, collective_backend, synchronize

BUCKET, END, ABORT = 1, 2, 3


def _meta_tensor(meta: Mapping[str, Any], device: torch.device) -> torch.Tensor:
    raw = json.dumps(meta).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


class _Link:
    """What both ends of one sync read from the connected transport."""

    def __init__(self, transport: BroadcastTransport) -> None:
        assert transport.group is not None
        self.group = transport.group
        self.buffers = transport.buffers
        self.device = transport.device
        self.root = transport.root
        self.timeout = transport.config.deadline_s(self.buffers[0].numel())  # one bucket
        self.transport = transport
        self.broken = False


class _Sender(_Link):
    def __init__(self, transport: BroadcastTransport) -> None:
        super().__init__(transport)
        self._pending: dict[int, list[int]] = {}  # buffer -> tickets of its broadcasts
        self._keep: dict[int, list[torch.Tensor]] = {}

    def _announce(self, kind: int, meta: Mapping[str, Any], data_len: int, index: int) -> list[int]:
        body = _meta_tensor(meta, self.device)
        head = torch.tensor([kind, body.numel(), data_len, index], dtype=torch.int64)
        head = head.to(self.device)
        tickets = [self.group.broadcast(t, self.root) for t in (head, body)]
        self._keep[index] = [head, body]
        return tickets

    def _wait_all(self, tickets: list[int]) -> None:
        try:
            for ticket in tickets:
                self.group.wait(ticket, self.timeout)
        except WeightSyncError as exc:
            self.broken = True
            raise WeightSyncError(f"broadcast failed ({self._who()}): {exc}") from exc

    def _who(self) -> str:
        """The receivers that stopped beating (stopped, hung machine, or dead), else that one
        died or timed out (a wait of a few seconds, on the failure path only)."""
        silent = self.group.silent(self.transport.receivers)
        if not silent:
            return "a receiver died or timed out"
        ranks = ", ".join(str(rank) for rank in silent)
        return f"receiver {ranks} stopped: alive but silent, or dead"

    def post(self, index: int, header: dict[str, Any]) -> None:
        synchronize(self.device)  # the collective's stream does not wait for the packing
        tickets = self._announce(BUCKET, header, header["nbytes"], index)
        data = self.buffers[index][: header["nbytes"]]
        tickets.append(self.group.broadcast(data, self.root))
        self._pending[index] = tickets

    def wait(self, index: int) -> None:
        self._wait_all(self._pending.pop(index, []))

    def finish(self, summary: dict[str, Any]) -> None:
        self._wait_all(self._announce(END, summary, 0, -1))
        verdict = torch.zeros(1, dtype=torch.int64, device=self.device)
        try:
            self.group.all_reduce_max(verdict, self.timeout)
        except WeightSyncError as exc:
            self.broken = True
            raise WeightSyncError(
                f"a receiver did not confirm the stream ({self._who()}): {exc}"
            ) from exc
        if int(verdict.item()) != 0:
            raise WeightSyncError("a receiver rejected the stream (its log says why)")

    def abort(self, reason: str) -> None:
        if self.broken:
            return  # the group is unusable; its abort key already told the receivers
        try:
            self._wait_all(list(self._pending.pop(0, [])) + list(self._pending.pop(1, [])))
            self._wait_all(self._announce(ABORT, {"reason": reason}, 0, -1))
        except WeightSyncError:
            self.broken = True


class _Receiver(_Link):
    read_ahead = True  # see ReceiverLink.read_ahead

    def __init__(self, transport: BroadcastTransport) -> None:
        super().__init__(transport)
        self._free = [threading.Semaphore(1), threading.Semaphore(1)]
        self._index = 0

    def _receive(self, tensor: torch.Tensor) -> None:
        try:
            self.group.wait(self.group.broadcast(tensor, self.root), self.timeout)
        except WeightSyncError as exc:
            self.broken = True
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

    def ready(self, index: int) -> None:
        synchronize(self.device)  # the reader thread's collective filled it on its stream

    def release(self, index: int) -> None:
        synchronize(self.device)  # the consumer's copies out are done before it is refilled
        self._free[index].release()

    def close(self) -> None:
        """The consumer left early: never leave the reader waiting for a free buffer."""
        for free in self._free:
            free.release()

    def confirm(self, ok: bool, detail: str) -> None:
        verdict = torch.tensor([0 if ok else 1], dtype=torch.int64).to(self.device)
        try:
            self.group.all_reduce_max(verdict, self.timeout)
        except WeightSyncError as exc:
            self.broken = True
            raise WeightSyncError(f"confirming the stream to the sender failed: {exc}") from exc


class BroadcastTransport(BucketTransport):
    config: BroadcastConfig

    def __init__(self, config: BroadcastConfig) -> None:
        super().__init__(config)
        self._store: Any = None
        self.group: groups.Group | None = None
        self.buffers: list[torch.Tensor] = []
        self.device = torch.device("cpu")
        self.role: TransportRole | None = None
        self.root = 0
        self.receivers: tuple[int, ...] = ()

    def prepare(self) -> Mapping[str, Any]:
        self.finalize()  # a second prepare (reconnecting) must not leak the first's group
        device = bucket_device(self.config.device)
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
        self.device = bucket_device(self.config.device)
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
        size = int(endpoint["bucket_bytes"])  # the sender's size, whatever ours says
        # the group's own timeout must not end a wait before its deadline (one bucket's)
        group_timeout = self.config.deadline_s(size)
        self.group = groups.Group(backend, store, rank, topology.world_size, group_timeout)
        self.root = topology.senders[0]
        self.receivers = tuple(topology.receivers)
        try:  # everyone joined: the first sync does not pay for connection setup
            zero = torch.zeros(1, dtype=torch.int64).to(self.device)
            self.group.all_reduce_max(zero, timeout)
        except WeightSyncError as exc:
            raise WeightSyncError(f"joining the weight-sync group failed: {exc}") from exc
        self.layouts.clear()
        self.buffers = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in (0, 1)]
        self.role = role
        if role is TransportRole.RECEIVER:  # the sender names a stopped receiver by it
            self.group.beat()

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
        """A failed collective leaves the group unusable (every participant saw the abort
        key): abort it, so nothing stays blocked on a dead peer, and require a new connect()."""
        if self.group is not None:
            self.group.shut_down(abort=True)
        self.group = None

    def finalize(self) -> None:
        self.layouts.clear()
        if self.group is not None:
            self.group.shut_down(abort=False)
        self.group = None
        self.buffers = []
        self._store = None
        self.role = None
