"""The weight path's one owner: the sequence around every weight update, for every placement.

    with manager.updating(version):     # colocated: rollouts sleep while the trainer trains
        ... train ...
    # on leaving: wake the rollouts' weights, then sync, then wake their KV cache

    sync(version):
        pause generation (wait for, or abort, in-flight requests)
        send ‖ receive                  (the trainer's sender and every rollout at once)
        resume generation               (also after a failure: a rollout that got part of
                                         the weights refuses requests until the next sync)

Nothing here touches tensors: the sender is any function ``send(version, base)`` (an engine
rank exporting into a transport, or a Ray call doing so; ``base`` is the version every rollout
last confirmed, which a sender's ledger sends the difference from); each rollout (in this
process, or behind
a :class:`~drivetrain.runtime.remote_rollout.RemoteRollout` proxy) has a receiving end
(:class:`~drivetrain.runtime.weight_receiver.WeightReceiver`, kept here or by the rollout's host)
joined to the same transport by :func:`connect_rollouts`. In-process placement uses the
``direct`` transport (:mod:`drivetrain.runtime.direct_transport`; ``colocated`` for a rollout in a
server process), so one sequence serves every placement.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import AbstractContextManager
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
from drivetrain.runtime.daemon_pool import DaemonPool
from drivetrain.runtime.fingerprint import first_difference
from drivetrain.runtime.remote_rollout import RemoteRollout
from drivetrain.runtime.weight_ledger import WeightLedger
from drivetrain.runtime.weight_receiver import Receiving, WeightReceiver

SendFn = Callable[[int, int | None], SyncStats | None]


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
            f"{prefix}skipped_bytes": float(self.sent.skipped_bytes),
            f"{prefix}gb_per_s": self.gb_per_s,
            f"{prefix}version": float(self.version),
        }
        out.update({f"{prefix}{name}_s": value for name, value in self.phases.items()})
        return out


def engine_sender(
    export: Callable[[], Iterable[NamedTensor]],
    transport: WeightTransport | None,
    ledger: WeightLedger | None = None,
) -> SendFn:
    """``send(version, base)`` for one engine rank: the rank that holds ``transport`` sends
    the export (through ``ledger``, when it keeps one: fingerprinted, and only what changed
    since ``base``); the others (``transport=None``) consume it, since exporting runs
    collectives."""

    def send(version: int, base: int | None = None) -> SyncStats | None:
        if transport is None:
            drain(export())
            return None
        if ledger is None:
            return transport.send(export(), version=version)
        stream = ledger.stream(export(), version=version, base=base)
        return ledger.stamp(transport.send(stream, version=version))

    return send


def _all_at_once(calls: Sequence[Callable[[], Any]], *, settle: bool = False) -> list[Any]:
    """Run ``calls`` in threads and wait for all. Without ``settle`` the first failure is
    raised once all ended; with it, failures are returned in place of results."""
    if len(calls) == 1:
        try:
            return [calls[0]()]
        except Exception as exc:
            if settle:
                return [exc]
            raise
    with ThreadPoolExecutor(len(calls), thread_name_prefix="weight-sync") as pool:
        futures = [pool.submit(call) for call in calls]
        results: list[Any] = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:
                results.append(exc)
    failures = [r for r in results if isinstance(r, Exception)]
    if failures and not settle:
        raise failures[0]
    return results


def receiver_for(rollout: Rollout) -> Receiving:
    """The rollout's receiving end: in its host's process for a proxy, else here."""
    if isinstance(rollout, RemoteRollout):
        return rollout.weight_receiver()
    return WeightReceiver(rollout)


def connect_rollouts(
    sender: Callable[[Topology, Mapping[str, Any]], None],
    endpoint: Mapping[str, Any],
    transport: str,
    config: Any,
    rollouts: Sequence[Rollout],
) -> list[Receiving]:
    """Join the sending side (``sender(topology, endpoint)``, rank 0) and every rollout's
    receiving end (rank ``i + 1``) into one transport group; ``transport`` is the plugin name
    the receivers load on their side. Connecting is collective, so every side runs at once.
    Returns the connected receivers, in the rollouts' order."""
    topology = Topology.one_sender(len(rollouts))
    receivers = [receiver_for(rollout) for rollout in rollouts]
    calls: list[Callable[[], Any]] = [lambda: sender(topology, endpoint)]
    for rank, receiver in zip(topology.receivers, receivers, strict=True):
        calls.append(
            lambda receiver=receiver, rank=rank: receiver.connect(
                transport, config, rank=rank, topology=topology, endpoint=endpoint
            )
        )
    _first_failure_ends(calls)
    return receivers


def _first_failure_ends(calls: Sequence[Callable[[], Any]]) -> None:
    """Run ``calls`` at once; the first to fail raises at once. Joining a group is
    collective: a receiver that cannot join (its transport not installed in its environment)
    leaves the others waiting for it until their deadline, and their 'only 0 of 1 receivers
    connected' would hide its one-line cause; they are abandoned (daemon threads) instead."""
    pool = DaemonPool(len(calls), name="weight-connect")
    try:
        pending = {pool.submit(call) for call in calls}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
    finally:
        pool.abandon()


def connect_transport(
    sender: WeightTransport, transport: str, rollouts: Sequence[Rollout]
) -> list[Receiving]:
    """:func:`connect_rollouts` for a sending transport object in this process."""

    def join(topology: Topology, endpoint: Mapping[str, Any]) -> None:
        sender.connect(TransportRole.SENDER, 0, topology, endpoint)

    return connect_rollouts(join, sender.prepare(), transport, sender.config, rollouts)


class WeightSyncManager:
    """Runs :meth:`sync` every step for ``rollouts``, whose connected ``receivers`` (from
    :func:`connect_rollouts`, in the same order) take the weights. ``abort_inflight`` ends
    running requests instead of waiting for them; ``colocated`` puts the rollouts to sleep while
    the trainer updates (they share its device) and wakes them by tag around the transfer;
    ``provenance`` checks after each sync that every rollout serves what was sent (when the
    sender kept fingerprints: ``weight_sync.delta`` keeps them too, for its own use)."""

    def __init__(
        self,
        send: SendFn,
        rollouts: Sequence[Rollout],
        receivers: Sequence[Receiving],
        *,
        abort_inflight: bool = False,
        colocated: bool = False,
        excused: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
        provenance: bool = True,
    ) -> None:
        if not rollouts:
            raise ValueError("a weight sync needs at least one rollout")
        if len(receivers) != len(rollouts):
            raise ValueError(f"{len(rollouts)} rollouts but {len(receivers)} receivers")
        self.send = send
        self.rollouts = tuple(rollouts)
        self.receivers = tuple(receivers)
        self.abort_inflight = abort_inflight
        self.colocated = colocated
        self.provenance = provenance
        #: around a sync or an update: the rollouts' silence is ours (their service's
        #: progress deadline does not count it)
        self.excused = excused
        self.reports: list[SyncReport] = []
        #: The last version every rollout received whole (and, where checked, serves).
        self.confirmed: int | None = None

    def _each(self, method: str, *args: Any, settle: bool = False, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every rollout at once. ``settle``: call it on all of them even if
        some fail (clean-up), then raise the first failure."""
        calls = [
            lambda r=r: getattr(r, method)(*args, **kwargs)  # type: ignore[misc]
            for r in self.rollouts
        ]
        results = _all_at_once(calls, settle=settle)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]
        return results

    @contextlib.contextmanager
    def updating(self, version: int) -> Iterator[None]:
        """Around a training update: colocated rollouts sleep (the trainer gets the device),
        then wake their weights, receive ``version``, and wake their KV cache. The report is
        in :attr:`reports`. If the update raises, the rollouts wake and nothing is sent."""
        if not self.colocated:
            yield
            self.sync(version)
            return
        with self.excused():  # asleep while the trainer updates: their silence is ours
            self._each("sleep", 1)
            try:
                yield
            except BaseException:
                self._each("wake_up", None, settle=True)
                raise
            try:
                self._each("wake_up", ("weights",))
                self.sync(version)
            finally:
                self._each("wake_up", ("kv_cache",), settle=True)

    def sync(self, version: int) -> SyncReport:
        """One whole sync; raises :class:`WeightSyncError` if any side fails (generation
        resumed; a rollout that did not finish kept its old weights, or, when some of the new
        ones had landed, refuses requests until the next sync)."""
        with self.excused():
            return self._sync(version)

    def _sync(self, version: int) -> SyncReport:
        phases: dict[str, float] = {}
        start = time.perf_counter()
        try:
            aborted = sum(self._each("pause_generation", abort=self.abort_inflight))
            phases["pause"] = time.perf_counter() - start
            start = time.perf_counter()
            sent, received = self._transfer(version)
            phases["transfer"] = time.perf_counter() - start
            start = time.perf_counter()
            if sent.fingerprints and self.provenance:
                self._check_provenance(version, sent.fingerprints)
                phases["provenance"] = time.perf_counter() - start
                start = time.perf_counter()
            self.confirmed = version
        finally:
            self._each("resume_generation", settle=True)  # whatever failed, they serve again
        phases["resume"] = time.perf_counter() - start
        report = SyncReport(version, sent, tuple(received), phases, aborted)
        self.reports.append(report)
        return report

    def _check_provenance(self, version: int, sent: Mapping[str, str]) -> None:
        """Every rollout that can fingerprint its weights serves exactly what was sent."""
        served = self._each("weights_fingerprint", sent)
        for index, actual in enumerate(served):
            if actual is None:  # this backend cannot tell (e.g. it fuses or shards weights)
                continue
            differs = first_difference(sent, actual)
            if differs is not None:
                name, want, got = differs
                raise WeightSyncError(
                    f"rollout {index} does not serve weights version {version}: tensor "
                    f"{name!r} has fingerprint {got}, the trainer sent {want} (the rollout "
                    "lost or misapplied part of the stream)"
                )

    def _transfer(self, version: int) -> tuple[SyncStats, list[SyncStats]]:
        calls: list[Callable[[], Any]] = [lambda: self.send(version, self.confirmed)]
        calls += [lambda r=r: r.receive(version) for r in self.receivers]
        results = _all_at_once(calls, settle=True)
        failures = [r for r in results if isinstance(r, Exception)]
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

    def close(self) -> None:
        """Every receiver leaves the transport (each tried, the first failure raised)."""
        results = _all_at_once([r.disconnect for r in self.receivers], settle=True)
        failures = [r for r in results if isinstance(r, Exception)]
        if failures:
            raise failures[0]
