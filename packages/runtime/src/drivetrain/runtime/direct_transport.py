"""``direct``: the weight-sync transport between threads of one process (in-process placement).

The sender hands each tensor of the engine's export stream to every receiver as it is (no copy,
no bucket) and waits until each receiver has asked for the next one, so a tensor that is a view
of the engine's buffers is still valid while a rollout applies it. It is a transport like the
others, so the trainer drives every placement through one sync sequence
(:mod:`drivetrain.trainer.rl.sync_manager`); a receiver that fails or stops reading makes the sender
raise :class:`WeightSyncError` within the deadline, and a failing export aborts the receivers.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from drivetrain.api.engine import NamedTensor
from drivetrain.api.plugin import PluginSpec
from drivetrain.api.weight_sync import (
    Destination,
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)

DIRECT_TRANSPORT = PluginSpec(
    name="direct",
    factory="drivetrain.runtime.direct_transport:DirectTransport",
    config="drivetrain.api.config:WeightSyncConfig",
    api=">=0.1,<0.2",
    capabilities=frozenset({"device:cpu", "device:cuda", "device:npu"}),
    description="in-process hand-off of the engine's tensors to rollouts (no copy)",
)


class _Link:
    """One receiver's side of the channel. Each sync is one ``send`` and one ``receive`` per
    receiver (the sync manager's sequence), numbered on both sides, so a message or an abort
    of an earlier sync never reaches a later one, and a receiver that starts reading only after
    its sync was aborted learns so at once. The condition orders the two sides."""

    def __init__(self) -> None:
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=1)
        self.taken = threading.Semaphore(0)
        self.sent = 0  # syncs the sender started
        self.read = 0  # syncs the receiver started
        self.failure: tuple[int, str] | None = None  # (sync, why) the receiver gave up
        self.aborted: dict[int, str] = {}  # sync -> why the sender gave up
        self.reading = False
        self.lock = threading.Condition()

    def drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.inbox.get_nowait()

    def failed(self, sync: int) -> str | None:
        return self.failure[1] if self.failure is not None and self.failure[0] == sync else None


_CHANNELS: dict[str, dict[int, _Link]] = {}
_IDS = itertools.count()
_LOCK = threading.Lock()


def _nbytes(tensor: Any) -> int:
    return int(getattr(tensor, "nbytes", 0))


class DirectTransport(WeightTransport):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._name: str | None = None
        self._links: dict[int, _Link] = {}
        self._link: _Link | None = None

    def prepare(self) -> Mapping[str, Any]:
        self.finalize()
        with _LOCK:
            self._name = f"direct-{next(_IDS)}"
            _CHANNELS[self._name] = {}
        return {"channel": self._name}

    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        with _LOCK:
            links = _CHANNELS.get(str(endpoint.get("channel")))
            if links is None:
                raise WeightSyncError(
                    f"no direct weight-sync channel {endpoint.get('channel')!r} in this process:"
                    " the direct transport joins a trainer and rollouts of one process only"
                )
            if role is TransportRole.RECEIVER:
                self._link = links[rank] = _Link()
        if role is TransportRole.SENDER:
            self._links = links

    def _deliver(self, item: tuple[Any, ...], deadline: float) -> None:
        """Put ``item`` in every inbox and wait until every receiver took it."""
        for rank, link in self._links.items():
            if (why := link.failed(link.sent)) is not None:
                raise WeightSyncError(f"receiver {rank} failed: {why}")
            try:
                link.inbox.put((link.sent, *item), timeout=max(0.0, deadline - time.monotonic()))
            except queue.Full:
                raise WeightSyncError(f"receiver {rank} is not reading the stream") from None
        for rank, link in self._links.items():
            if not link.taken.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise WeightSyncError(f"receiver {rank} took nothing for {self.config.timeout_s} s")
            if (why := link.failed(link.sent)) is not None:
                raise WeightSyncError(f"receiver {rank} failed: {why}")

    def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        if not self._links:
            raise WeightSyncError("the direct transport's sender is not connected to receivers")
        for link in self._links.values():
            with link.lock:
                link.sent += 1
                link.taken = threading.Semaphore(0)
        start = time.perf_counter()
        count = size = 0
        try:
            for name, tensor in weights:
                self._deliver(("tensor", name, tensor), time.monotonic() + self.config.timeout_s)
                count += 1
                size += _nbytes(tensor)
            self._deliver(("end", version, count, size), time.monotonic() + self.config.timeout_s)
        except BaseException as exc:
            self._abort(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
                raise
            raise WeightSyncError(f"sending version {version} failed: {exc}") from exc
        return SyncStats(version, count, count, size, time.perf_counter() - start)

    def _abort(self, reason: str) -> None:
        """Tell every receiver of this sync why it ends (now, or when it starts reading) and
        wait until those reading have left, so the channel is clean for the next sync."""
        deadline = time.monotonic() + self.config.timeout_s
        for link in self._links.values():
            with link.lock:
                link.drain()  # an item the receiver never took
                if link.read < link.sent:
                    link.aborted[link.sent] = reason  # it has not started this sync yet
                elif link.reading:
                    link.inbox.put_nowait((link.sent, "abort", reason))
        for link in self._links.values():
            with link.lock:
                link.lock.wait_for(
                    lambda link=link: not link.reading, max(0.0, deadline - time.monotonic())
                )
                link.drain()

    def receive(self, into: Destination | None = None) -> Iterator[NamedTensor]:
        del into  # whole tensors only: nothing to rebuild
        link = self._link
        if link is None:
            raise WeightSyncError("the direct transport's receiver is not connected")
        return self._receive(link)

    def _receive(self, link: _Link) -> Iterator[NamedTensor]:
        self.last_stats = None
        start = time.perf_counter()
        finished = False
        with link.lock:
            link.read += 1
            sync = link.read
            link.reading = True
        try:
            if sync in link.aborted:
                raise WeightSyncError(f"the sender aborted the sync: {link.aborted.pop(sync)}")
            while True:
                try:
                    message = link.inbox.get(timeout=self.config.timeout_s)
                except queue.Empty:
                    raise WeightSyncError(
                        f"the sender sent nothing for {self.config.timeout_s} s"
                    ) from None
                if message[0] != sync:
                    continue  # left over from an earlier sync
                if message[1] == "abort":
                    raise WeightSyncError(f"the sender aborted the sync: {message[2]}")
                if message[1] == "end":
                    _, _, version, count, size = message
                    elapsed = time.perf_counter() - start
                    self.last_stats = SyncStats(version, count, count, size, elapsed)
                    finished = True
                    link.taken.release()
                    return
                yield message[2], message[3]
                link.taken.release()  # the consumer asked for the next one
        finally:
            with link.lock:
                if not finished and link.failed(sync) is None:
                    link.failure = (sync, "the rollout stopped reading the stream")
                    link.taken.release()
                link.reading = False
                link.lock.notify_all()

    def finalize(self) -> None:
        if self._name is not None:
            with _LOCK:
                _CHANNELS.pop(self._name, None)
            self._name = None
        self._links = {}
        self._link = None
