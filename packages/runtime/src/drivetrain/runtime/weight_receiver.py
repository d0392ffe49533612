"""The receiving end of the weight path: one rollout joined to a weight-sync transport.

It lives in the process that holds the rollout's weights and belongs to the sync side (the
:class:`~drivetrain.trainer.rl.sync_manager.WeightSyncManager` keeps one per rollout; a server
process or Ray actor hosting a rollout keeps one next to it, see
:mod:`drivetrain.runtime.remote_rollout`).
Every sync is one call chain::

    transport.receive(into=rollout.weight_destination)  ->  rollout.update_weights(stream)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.rollout import Rollout
from drivetrain.api.weight_sync import (
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)


class Receiving(Protocol):
    """What the sync manager asks of a rollout's receiving end, here or in another process."""

    def connect(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None: ...

    def receive(self, version: int) -> SyncStats: ...

    def disconnect(self) -> None: ...


class WeightReceiver:
    """Joins ``rollout`` to a transport once and feeds it every sync."""

    def __init__(self, rollout: Rollout) -> None:
        self.rollout = rollout
        self.transport: WeightTransport | None = None

    def connect(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None:
        """Join ``transport`` (a ``drivetrain.ckpt_engines`` plugin) as receiver ``rank``;
        reused by every sync until :meth:`disconnect`."""
        self.disconnect()
        receiver = ckpt_engines.load(transport)(config)
        try:
            receiver.connect(TransportRole.RECEIVER, rank, topology, endpoint)
        except BaseException:  # what it opened before failing (segments, sockets) goes now
            with contextlib.suppress(Exception):
                receiver.finalize()
            raise
        self.transport = receiver

    def receive(self, version: int) -> SyncStats:
        """One sync into the rollout, applied as it arrives (a stream that fails part-way
        leaves the rollout refusing requests until the next sync, see
        :meth:`~drivetrain.runtime.request_queue.QueuedRollout.updating_weights`)."""
        if self.transport is None:
            raise WeightSyncError(
                "receive before connect: the rollout is not joined to a transport"
            )
        self.transport.last_stats = None
        stream = self.transport.receive(into=self.rollout.weight_destination)
        try:
            self.rollout.update_weights(stream, version=version)
        finally:  # a consumer that stopped early lets the transport know now, not at GC
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        stats = self.transport.last_stats
        if stats is None:
            raise WeightSyncError("the transport ended its stream without its statistics")
        if stats.version != version:  # a receiver that fell a sync behind
            raise WeightSyncError(f"expected weights version {version}, got {stats.version}")
        return stats

    def disconnect(self) -> None:
        if self.transport is not None:
            transport, self.transport = self.transport, None
            transport.finalize()
