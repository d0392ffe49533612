"""A pure-Python weight-sync transport between threads of one process (``fake``), so the
sync sequence and the trainer's orchestration are testable without torch.

The sender puts every tensor (a nested list, as the fake engine exports) into each receiver's
queue, then an end marker carrying counts and a digest; a receiver yields them and checks the
marker. ``fail_after`` in the config makes the sender raise after that many tensors.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import queue
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import (
    Destination,
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)

_CHANNELS: dict[str, dict[int, queue.Queue[Any]]] = {}
_IDS = itertools.count()


@dataclass(frozen=True)
class FakeTransportConfig(WeightSyncConfig):
    fail_after: int = -1  # >= 0: the sender raises after that many tensors


def _digest_update(digest: Any, name: str, value: Any) -> None:
    digest.update(name.encode() + b"|" + json.dumps(value).encode())


class FakeTransport(WeightTransport):
    config: FakeTransportConfig

    def __init__(self, config: WeightSyncConfig) -> None:
        if not isinstance(config, FakeTransportConfig):
            config = FakeTransportConfig(**vars(config))
        super().__init__(config)
        self.channel: dict[int, queue.Queue[Any]] | None = None
        self.rank = -1

    def prepare(self) -> Mapping[str, Any]:
        name = f"fake-{next(_IDS)}"
        _CHANNELS[name] = {}
        return {"channel": name}

    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        channel = _CHANNELS.get(endpoint["channel"])
        if channel is None:
            raise WeightSyncError(f"no fake channel {endpoint['channel']!r} in this process")
        if role is TransportRole.RECEIVER:
            channel[rank] = queue.Queue()
        self.channel, self.rank = channel, rank

    def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        if self.channel is None:
            raise WeightSyncError("not connected")
        start = time.perf_counter()
        digest = hashlib.sha256()
        count = size = 0
        try:
            for name, value in weights:
                if count == self.config.fail_after:
                    raise RuntimeError(f"fake failure after {count} tensors")
                _digest_update(digest, name, value)
                for q in self.channel.values():
                    q.put(("tensor", name, copy.deepcopy(value)))
                count += 1
                size += len(json.dumps(value))
        except Exception as exc:
            for q in self.channel.values():
                q.put(("abort", str(exc)))
            raise WeightSyncError(f"sending version {version} failed: {exc}") from exc
        summary = (version, count, digest.hexdigest())
        for q in self.channel.values():
            q.put(("end", *summary))
        return SyncStats(version, count, 1, size, time.perf_counter() - start, digest.hexdigest())

    def receive(self, into: Destination | None = None) -> Iterator[NamedTensor]:
        del into  # whole tensors only: nothing to rebuild
        if self.channel is None:
            raise WeightSyncError("not connected")
        inbox = self.channel[self.rank]
        start = time.perf_counter()
        digest = hashlib.sha256()
        count = size = 0
        while True:
            try:
                message = inbox.get(True, self.config.timeout_s)
            except queue.Empty:
                raise WeightSyncError(f"nothing received for {self.config.timeout_s} s") from None
            if message[0] == "abort":
                raise WeightSyncError(f"the sender aborted: {message[1]}")
            if message[0] == "end":
                _, version, sent, sent_digest = message
                if (count, digest.hexdigest()) != (sent, sent_digest):
                    raise WeightSyncError("the received stream differs from the sent one")
                seconds = time.perf_counter() - start
                self.last_stats = SyncStats(version, count, 1, size, seconds, sent_digest)
                return
            _, name, value = message
            _digest_update(digest, name, value)
            count += 1
            size += len(json.dumps(value))
            yield name, value

    def finalize(self) -> None:
        self.channel = None
