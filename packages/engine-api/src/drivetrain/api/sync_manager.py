"""The weight-sync sequence around one transfer, the same for every transport and rollout.

    pause generation (wait for, or abort, in-flight requests)
    release the KV cache (colocated: the trainer just used that memory), weights resident
    send ‖ receive            (the trainer's sender and every rollout at once)
    restore the KV cache, resume generation

Nothing here touches tensors: the sender is any coroutine function ``send(version)`` (an engine
rank exporting into a transport, or a Ray call doing so), the receivers are
:class:`~drivetrain.api.rollout.Rollout` objects (in-process, in a server process or behind a
proxy) already joined to the transport with :meth:`Rollout.connect_weight_sync`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api.engine import NamedTensor
from drivetrain.api.rollout import Rollout
from drivetrain.api.weight_sync import (
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
    drain,
)

SendFn = Callable[[int], Awaitable[SyncStats | None]]


@dataclass(frozen=True)
class SyncReport:
    """One sync as the manager saw it: the sender's statistics, each rollout's, and the time
    spent per phase (seconds)."""

    version: int
    sent: SyncStats
    received: tuple[SyncStats, ...]
    phases: Mapping[str, float] = field(default_factory=dict)
    aborted_requests: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def gb_per_s(self) -> float:
        """Bytes moved over the transfer phase (what the trainer waits for)."""
        transfer = self.phases.get("transfer", 0.0)
        return self.sent.bytes / transfer / 1e9 if transfer > 0 else float("inf")

    def metrics(self, prefix: str = "weight_sync/") -> dict[str, float]:
        out = {
            f"{prefix}seconds": self.seconds,
            f"{prefix}bytes": float(self.sent.bytes),
            f"{prefix}gb_per_s": self.gb_per_s,
            f"{prefix}version": float(self.version),
        }
        out.update({f"{prefix}{name}_s": value for name, value in self.phases.items()})
        return out


def engine_sender(
    export: Callable[[], Iterable[NamedTensor]], transport: WeightTransport | None
) -> SendFn:
    """``send(version)`` for one engine rank: the rank that holds ``transport`` sends the
    export; the others (``transport=None``) consume it, since exporting runs collectives."""

    async def send(version: int) -> SyncStats | None:
        if transport is None:
            await drain(export())
            return None
        return await transport.send(export(), version=version)

    return send


async def connect_rollouts(
    sender: WeightTransport, transport: str, rollouts: Sequence[Rollout]
) -> Topology:
    """Join ``sender`` (rank 0) and every rollout (rank ``i + 1``) into one transport group;
    ``transport`` is the plugin name the rollouts load on their side."""
    endpoint = sender.prepare()
    topology = Topology.one_sender(len(rollouts))
    await asyncio.gather(
        asyncio.to_thread(sender.connect, TransportRole.SENDER, 0, topology, endpoint),
        *(
            asyncio.to_thread(
                rollout.connect_weight_sync,
                transport,
                sender.config,
                rank=rank,
                topology=topology,
                endpoint=endpoint,
            )
            for rank, rollout in zip(topology.receivers, rollouts, strict=True)
        ),
    )
    return topology


class WeightSyncManager:
    """Runs :meth:`sync` every step. ``abort_inflight`` ends running requests instead of
    waiting for them; ``release_kv_cache`` frees the rollouts' KV cache around the transfer
    (colocated placement, where the trainer shares the device)."""

    def __init__(
        self,
        send: SendFn,
        rollouts: Sequence[Rollout],
        *,
        abort_inflight: bool = False,
        release_kv_cache: bool = False,
    ) -> None:
        if not rollouts:
            raise ValueError("a weight sync needs at least one rollout")
        self.send = send
        self.rollouts = tuple(rollouts)
        self.abort_inflight = abort_inflight
        self.release_kv_cache = release_kv_cache
        self.reports: list[SyncReport] = []

    async def _each(
        self, method: str, *args: Any, settle: bool = False, **kwargs: Any
    ) -> list[Any]:
        """Call ``method`` on every rollout at once. ``settle``: call it on all of them even if
        some fail (clean-up), then raise the first failure."""
        calls = (asyncio.to_thread(getattr(r, method), *args, **kwargs) for r in self.rollouts)
        results = list(await asyncio.gather(*calls, return_exceptions=settle))
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return results

    async def sync(self, version: int) -> SyncReport:
        """One whole sync; raises :class:`WeightSyncError` (generation resumed with its KV
        cache, old weights in use on every rollout that did not finish) if any side fails."""
        phases: dict[str, float] = {}
        start = time.perf_counter()
        released = False
        try:
            paused = await self._each("pause_generation", abort=self.abort_inflight)
            aborted = sum(paused)
            if self.release_kv_cache:
                released = True
                await self._each("sleep", 1)
                await self._each("wake_up", ("weights",))
            phases["pause"] = time.perf_counter() - start
            start = time.perf_counter()
            sent, received = await self._transfer(version)
            phases["transfer"] = time.perf_counter() - start
            start = time.perf_counter()
        finally:
            # whatever failed, every rollout serves again, with its KV cache
            if released:
                await self._each("wake_up", ("kv_cache",), settle=True)
            await self._each("resume_generation", settle=True)
        phases["resume"] = time.perf_counter() - start
        report = SyncReport(version, sent, tuple(received), phases, aborted)
        self.reports.append(report)
        return report

    async def _transfer(self, version: int) -> tuple[SyncStats, list[SyncStats]]:
        results = await asyncio.gather(
            self.send(version),
            *(asyncio.to_thread(r.receive_weights, version) for r in self.rollouts),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            detail = "; ".join(f"{type(f).__name__}: {f}" for f in failures)
            raise WeightSyncError(f"weight sync to version {version} failed: {detail}") from (
                failures[0]
            )
        sent, *received = results
        if sent is None:
            raise WeightSyncError("the send function returned no statistics (not the sender?)")
        for stats in received:
            if sent.digest is not None and stats.digest != sent.digest:
                raise WeightSyncError(
                    f"a rollout received digest {stats.digest}, the sender sent {sent.digest}"
                )
        return sent, received
