"""``colocated``: trainer and rollout on one machine (one GPU, or the CPU) — no collective.

The sender owns two bucket buffers that every receiver maps into its own address space: POSIX
shared memory on the CPU, CUDA IPC handles on a GPU. A bucket's metadata goes over a small
authenticated loopback channel; each receiver copies its tensors out and says the buffer is
free again, while the sender already packs the next bucket into the other buffer. On a GPU
the messages only say that a copy is queued: the streams order the copies themselves through
interprocess events (:mod:`shared_buffers`), so neither host waits for the device per bucket.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from multiprocessing import connection as mpc
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch

from drivetrain.api.weight_sync import (
    Topology,
    TransportRole,
    WeightSyncError,
)
from drivetrain.ckpt import channel
from drivetrain.ckpt.bucket_transport import BucketTransport
from drivetrain.ckpt.config import ColocatedConfig
from drivetrain.ckpt.devices import bucket_device
from drivetrain.ckpt.shared_buffers import CudaIpcBuffers, SharedMemoryBuffers

SharedBuffers = SharedMemoryBuffers | CudaIpcBuffers


class _Sender:
    def __init__(self, shared: SharedBuffers, conns: dict[int, Connection], timeout: float):
        self.shared = shared
        self.buffers = shared.buffers
        self.conns = conns
        self.timeout = timeout
        self.outstanding: dict[int, set[int]] = {0: set(), 1: set()}
        self.version = -1
        self.broken = False

    def _broadcast(self, message: Any) -> None:
        for rank, conn in self.conns.items():
            try:
                channel.send(conn, message, f"receiver {rank}")
            except WeightSyncError:
                self.broken = True
                raise

    def _collect(self, done: Callable[[list[Any]], bool]) -> list[Any]:
        """Read receivers' messages (in any order) until ``done(replies)``, where replies are
        the messages other than buffer releases; a silent or dead receiver raises."""
        replies: list[Any] = []
        by_conn = {conn: rank for rank, conn in self.conns.items()}
        while not done(replies):
            # a receiver that already gave its final reply may close its end: not a failure
            replied = {rank for rank, _ in replies}
            waiting = [conn for conn, rank in by_conn.items() if rank not in replied]
            ready = mpc.wait(waiting, timeout=self.timeout)
            if not ready:
                self.broken = True
                raise WeightSyncError(f"{self._silent(waiting, by_conn)} for {self.timeout:.0f} s")
            for conn in ready:
                rank = by_conn[conn]  # type: ignore[index]
                try:
                    message = channel.read(conn, f"receiver {rank}")  # type: ignore[arg-type]
                except WeightSyncError:
                    self.broken = True
                    raise
                if message[0] == "free":
                    if message[2] == self.version:  # a failed sync's late frees mean nothing
                        self.outstanding[message[1]].discard(rank)
                else:
                    replies.append((rank, message))
        return replies

    def _silent(self, waiting: list[Connection], by_conn: dict[Connection, int]) -> str:
        """Who kept us waiting: the receivers still holding a bucket, else those whose reply
        is missing (by rank, so the stuck one is named)."""
        holding = set().union(*self.outstanding.values())
        ranks = sorted(by_conn[c] for c in waiting if by_conn[c] in holding) or sorted(
            by_conn[c] for c in waiting
        )
        who = ", ".join(str(rank) for rank in ranks)
        return f"receiver{'s' if len(ranks) > 1 else ''} {who} sent nothing"

    def post(self, index: int, header: dict[str, Any]) -> None:
        self.shared.packed(index)
        self.version = header["version"]
        self.outstanding[index] = set(self.conns)
        self._broadcast(("bucket", index, header))

    def wait(self, index: int) -> None:
        self._collect(lambda _: not self.outstanding[index])
        self.shared.reusable(index)

    def finish(self, summary: dict[str, Any]) -> None:
        self._broadcast(("end", summary))
        replies = self._collect(lambda got: len(got) >= len(self.conns))
        rejected = [f"receiver {rank}: {m[2]}" for rank, m in replies if not m[1]]
        if rejected:
            raise WeightSyncError("receivers rejected the stream: " + "; ".join(rejected))

    def abort(self, reason: str) -> None:
        for rank, conn in self.conns.items():
            try:
                channel.send(conn, ("abort", reason), f"receiver {rank}")
            except Exception:
                self.broken = True  # that receiver is gone; the others still hear it


class _Receiver:
    read_ahead = False  # see ReceiverLink.read_ahead

    def __init__(self, shared: SharedBuffers, conn: Connection, timeout: float) -> None:
        self.shared = shared
        self.buffers = shared.buffers
        self.conn = conn
        self.timeout = timeout
        self.versions: dict[int, int] = {}  # buffer -> the sync its current bucket belongs to

    def next(self) -> tuple[str, dict[str, Any], int]:
        message = channel.receive(self.conn, self.timeout, "the sender")
        if message[0] == "bucket":
            self.versions[message[1]] = message[2]["version"]
            return "bucket", message[2], message[1]
        if message[0] == "end":
            return "end", message[1], -1
        if message[0] == "abort":
            raise WeightSyncError(f"the sender aborted the sync: {message[1]}")
        raise WeightSyncError(f"unexpected message {message[0]!r} from the sender")

    def ready(self, index: int) -> None:
        self.shared.arrived(index)

    def release(self, index: int) -> None:
        self.shared.consumed(index)
        channel.send(self.conn, ("free", index, self.versions[index]), "the sender")

    def confirm(self, ok: bool, detail: str) -> None:
        channel.send(self.conn, ("done", ok, detail), "the sender")


class ColocatedTransport(BucketTransport):
    config: ColocatedConfig

    def __init__(self, config: ColocatedConfig) -> None:
        super().__init__(config)
        self.device = torch.device("cpu")
        self.shared: SharedBuffers | None = None
        self._listener: Listener | None = None
        self.conns: dict[int, Connection] = {}
        self.conn: Connection | None = None
        self.role: TransportRole | None = None
        self._owner = False  # the sender created the buffers and unlinks them

    def _new_buffers(self, device: torch.device) -> SharedBuffers:
        if device.type == "cpu":
            return SharedMemoryBuffers.create(self.config.bucket_bytes)
        if device.type == "cuda":
            return CudaIpcBuffers.create(self.config.bucket_bytes, device)
        raise WeightSyncError(
            f"colocated sync shares memory on cpu (shared memory) or cuda (IPC), not on "
            f"{device.type!r}; use the broadcast transport there"
        )

    def prepare(self) -> Mapping[str, Any]:
        self.finalize()  # a second prepare (reconnecting) must not leak the first's segments
        self.device = bucket_device(self.config.device)
        self.shared = self._new_buffers(self.device)
        self._owner = True
        self._listener, endpoint = channel.listen(self.config.host)
        return {**endpoint, **self.shared.describe(), "pid": os.getpid()}

    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        timeout = self.config.timeout_s
        self.layouts.clear()
        if role is TransportRole.SENDER:
            if self._listener is None or self.shared is None:
                raise WeightSyncError("the sender must call prepare() before connect()")
            conns = channel.accept(self._listener, len(topology.receivers), timeout)
            hello = {channel.receive(c, timeout, "a receiver")["rank"]: c for c in conns}
            if sorted(hello) != sorted(topology.receivers):
                raise WeightSyncError(f"receivers {sorted(hello)} != {topology.receivers}")
            for peer, conn in hello.items():
                channel.send(conn, self.shared.handles(), f"receiver {peer}")
            for peer, conn in hello.items():
                reply = channel.receive(conn, timeout, f"receiver {peer}")
                if not (isinstance(reply, dict) and reply.get("status") == "attached"):
                    raise WeightSyncError(f"receiver {peer} could not map the buffers: {reply}")
                self.shared.add_peer(peer, reply.get("events"))
            self.conns = hello
        else:
            if rank not in topology.receivers:
                raise WeightSyncError(f"rank {rank} is not a receiver in {topology}")
            conn = channel.connect(dict(endpoint), timeout)
            channel.send(conn, {"rank": rank, "pid": os.getpid()}, "the sender")
            handles = channel.receive(conn, timeout, "the sender")
            try:
                self.shared = (
                    SharedMemoryBuffers.attach(endpoint)
                    if endpoint["kind"] == "shm"
                    else CudaIpcBuffers.attach(endpoint, handles)
                )
            except Exception as exc:
                channel.send(conn, f"{type(exc).__name__}: {exc}", "the sender")
                raise WeightSyncError(f"cannot map the sender's buffers: {exc}") from exc
            reply = {"status": "attached", "events": self.shared.peer_handles()}
            channel.send(conn, reply, "the sender")
            self.device = self.shared.buffers[0].device
            self.conn = conn
        self.role = role

    def _sender_link(self) -> _Sender:
        if self.role is not TransportRole.SENDER or not self.conns or self.shared is None:
            raise WeightSyncError("not connected as the sender (or a receiver failed: reconnect)")
        return _Sender(self.shared, self.conns, self._bucket_deadline())

    def _receiver_link(self) -> _Receiver:
        if self.role is not TransportRole.RECEIVER or self.conn is None or self.shared is None:
            raise WeightSyncError("not connected as a receiver")
        # twice the sender's deadline: the sender, which sees every receiver, names a stuck
        # one and aborts the rest first, rather than a waiting receiver giving up and leaving
        # the sender to report that one's departure
        return _Receiver(self.shared, self.conn, 2 * self._bucket_deadline())

    def _bucket_deadline(self) -> float:
        assert self.shared is not None
        return self.config.deadline_s(self.shared.buffers[0].numel())

    def _on_broken(self) -> None:
        self._close_conns()

    def _close_conns(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns = {}

    def finalize(self) -> None:
        self.layouts.clear()  # views of the buffers: they must go before the buffers close
        self._close_conns()
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.shared is not None:
            self.shared.close(owner=self._owner)
            self.shared = None
        self.role = None
