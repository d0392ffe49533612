"""The weight-sync transport kit: checks any :class:`~drivetrain.api.weight_sync.WeightTransport`
against the contract the trainer's sync relies on, with the sender in this process and two
receiver processes (:mod:`drivetrain.testing.transport_receiver`).

A transport author writes a :class:`TransportHarness` (how to make the transport, weights to
send, how to digest and copy them) in an importable module and runs
:func:`run_transport_conformance`, or inherits :class:`TransportConformance` under pytest.
Standard library only; the harness brings the tensor library.
"""

from __future__ import annotations

import abc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import (
    SyncStats,
    Topology,
    TransportRole,
    WeightSyncError,
    WeightTransport,
)
from drivetrain.testing.kit_runner import KitCheckResult, KitConformance, run_checks
from drivetrain.testing.transport_receiver import DIED

RECEIVERS = 2
#: how long a receiver process may take to start (import its harness and tensor library,
#: build the transport) before the kit's timed part begins: a loaded machine's imports are
#: not the transport's deadline
STARTUP_S = 180.0


class TransportHarness(abc.ABC):
    """What the kit needs to know about a transport. The receivers build it again in their
    processes (``type(harness)()``), so the class must be importable and take no arguments."""

    #: how soon a failure (a dead receiver, a failing source) must reach every peer; the
    #: transport's own deadlines are set far above it, so only its abort signals count
    notice_s: float = 30.0
    #: extra ``sys.path`` entries the receiver processes need to import the harness (they run
    #: ``python -m drivetrain.testing.transport_receiver`` and import the harness class by
    #: ``module:qualname``): e.g. the directory of the test module that defines it
    sys_path: tuple[str, ...] = ()

    @abc.abstractmethod
    def make_transport(self, **overrides: Any) -> WeightTransport:
        """A transport of the kit's size: buckets small enough that :meth:`weights` needs
        several and splits one tensor; ``overrides`` are config fields (``timeout_s``)."""

    @abc.abstractmethod
    def weights(self, version: int) -> list[NamedTensor]:
        """A deterministic stream that differs by version: dtypes mixed, one tensor larger
        than a bucket, and at least 12 tensors."""

    @abc.abstractmethod
    def digest(self, weights: Iterable[NamedTensor]) -> str:
        """A hash of every name, dtype, shape and byte, in order."""

    @abc.abstractmethod
    def copy(self, tensor: Any) -> Any:
        """An owned copy of a tensor (a received one is a view valid until the next)."""

    @abc.abstractmethod
    def spec_of(self, tensor: Any) -> tuple[tuple[int, ...], str]:
        """Its shape and dtype name (``"bfloat16"``...), as ``receive(into=...)`` asks."""

    def write_into(self, destination: Any, value: Any) -> None:
        """Copy a yielded tensor into the receiver's own, as a rollout does with one the
        transport did not write in place. The default: ``destination.copy_(value)``."""
        destination.copy_(value)


# ---- the receivers and the sender ----------------------------------------------------------
class _Receivers:
    """``RECEIVERS`` receiver processes, each writing one JSON line per sync."""

    def __init__(
        self,
        h: TransportHarness,
        endpoint: Mapping[str, Any],
        topology: Topology,
        versions: list[int],
        overrides: dict[str, Any],
        *,
        die_after: int | None = None,
        stop_after: int | None = None,
        destination: bool = False,
    ) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="dt-transport-kit-"))
        cls = type(h)
        self.outs, self.procs, self.ready = [], [], []
        for rank in topology.receivers:
            out = self.work / f"rank{rank}.jsonl"
            spec = {
                "harness": f"{cls.__module__}:{cls.__qualname__}",
                "sys_path": list(h.sys_path),
                "overrides": overrides,
                "rank": rank,
                "senders": list(topology.senders),
                "receivers": list(topology.receivers),
                "endpoint": dict(endpoint),
                "versions": versions,
                "die_after": die_after if rank == topology.receivers[-1] else None,
                "stop_after": stop_after if rank == topology.receivers[-1] else None,
                "destination": destination,
                "out": str(out),
                "ready": str(self.work / f"rank{rank}.ready"),
            }
            self.ready.append(self.work / f"rank{rank}.ready")
            path = self.work / f"rank{rank}.json"
            path.write_text(json.dumps(spec))
            self.outs.append(out)
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "drivetrain.testing.transport_receiver", str(path)]
            with open(self.work / f"rank{rank}.err", "wb") as err:  # a pipe could fill and block
                self.procs.append(subprocess.Popen(command, env=env, stderr=err))

    def wait_started(self, within_s: float = STARTUP_S) -> None:
        """Until every receiver has imported its harness and built its transport, so that
        the checks' deadlines time the transport, not a loaded machine's imports."""
        end = time.monotonic() + within_s
        for rank, (proc, ready) in enumerate(zip(self.procs, self.ready, strict=True), 1):
            while not ready.exists():
                if proc.poll() is not None:
                    raise AssertionError(
                        f"receiver {rank} exited ({proc.returncode}) before it was ready: "
                        f"{self.stderr(rank - 1)}"
                    )
                if time.monotonic() > end:
                    raise AssertionError(
                        f"receiver {rank} had not started {within_s:.0f} s later (importing the "
                        f"harness and building the transport; STARTUP_S): {self.stderr(rank - 1)}"
                    )
                time.sleep(0.05)

    def results(self, within_s: float) -> tuple[list[list[dict[str, Any]]], list[int]]:
        end = time.monotonic() + within_s
        for rank, proc in enumerate(self.procs, 1):
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"receiver {rank} was still waiting {within_s:.0f} s later "
                    "(a failure must reach it through the transport)"
                ) from None
        return [self.lines(i) for i in range(len(self.outs))], [p.returncode for p in self.procs]

    def lines(self, index: int) -> list[dict[str, Any]]:
        """What receiver ``index`` (0-based) wrote so far, one dict per sync."""
        out = self.outs[index]
        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    def stderr(self, index: int) -> str:
        """The last lines receiver ``index`` (0-based) wrote to its stderr."""
        path = self.work / f"rank{index + 1}.err"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


def _with_sync(
    h: TransportHarness,
    versions: list[int],
    check: Callable[..., None],
    overrides: dict[str, Any] | None = None,
    **receiver_options: Any,
) -> None:
    """Connect a sender and the receivers, run ``check(sender, receivers)``, clean up."""
    overrides = overrides or {}
    sender = h.make_transport(**overrides)
    topology = Topology.one_sender(RECEIVERS)
    endpoint = sender.prepare()
    receivers = _Receivers(h, endpoint, topology, versions, overrides, **receiver_options)
    try:
        receivers.wait_started()
        sender.connect(TransportRole.SENDER, 0, topology, endpoint)
        check(sender, receivers)
    finally:
        receivers.kill()
        sender.finalize()


def _assert_whole(
    h: TransportHarness, line: dict[str, Any], version: int, rank: int, sent: list[NamedTensor]
) -> None:
    if "error" in line:
        raise AssertionError(f"receiver {rank}, version {version}: {line['error']}")
    names = [name for name, _ in sent]
    if line["names"] != names:
        missing = sorted(set(names) - set(line["names"]))
        raise AssertionError(
            f"receiver {rank}, version {version}: got {len(line['names'])} "
            f"tensors of {len(names)} (missing {missing[:3]}), or out of order"
        )
    if line["digest"] != h.digest(sent):
        raise AssertionError(
            f"receiver {rank}, version {version}: {_first_difference(h, line['tensors'], sent)}"
        )
    if line["version"] != version or line["num_tensors"] != len(sent):
        raise AssertionError(
            f"receiver {rank}: last_stats says version {line['version']}, "
            f"{line['num_tensors']} tensors; sent {version}, {len(sent)}"
        )


def _first_difference(
    h: TransportHarness, received: list[list[Any]], sent: list[NamedTensor]
) -> str:
    """Which tensor (in stream order) differs from the one sent, and how: dtype, shape, or
    bytes with dtype and shape as sent."""
    for (name, tensor), (_, shape, dtype, digest) in zip(sent, received, strict=True):
        want_shape, want_dtype = h.spec_of(tensor)
        if dtype != want_dtype:
            return f"tensor {name!r} arrived as {dtype}, sent as {want_dtype}"
        if tuple(shape) != tuple(want_shape):
            return f"tensor {name!r} arrived with shape {list(shape)}, sent {list(want_shape)}"
        if digest != h.digest([(name, tensor)]):
            return f"tensor {name!r} arrived with other bytes ({dtype}, shape {list(shape)})"
    return "the stream's digest differs from the one sent, though each tensor matches"


# ---- the checks ----------------------------------------------------------------------------
def check_two_syncs(h: TransportHarness) -> None:
    """Two syncs over one connection arrive whole at both receivers: the sender's names in
    its order, bitwise equal, the version in ``last_stats``; the sender's stats count them."""

    def check(sender: WeightTransport, receivers: _Receivers) -> None:
        for version in (1, 2):
            sent = h.weights(version)
            stats = sender.send(iter(sent), version=version)
            _assert_stats(stats, version, sent)
        lines, codes = receivers.results(h.notice_s)
        for rank, (per_rank, code) in enumerate(zip(lines, codes, strict=True), 1):
            if code != 0 or len(per_rank) != 2:
                raise AssertionError(
                    f"receiver {rank} exited {code} after {len(per_rank)} "
                    f"syncs: {receivers.stderr(rank - 1)}"
                )
            for version, line in zip((1, 2), per_rank, strict=True):
                _assert_whole(h, line, version, rank, h.weights(version))

    _with_sync(h, [1, 2], check)


def _assert_stats(stats: SyncStats, version: int, sent: list[NamedTensor]) -> None:
    if not isinstance(stats, SyncStats) or stats.version != version:
        raise AssertionError(f"send returned {stats!r:.200}, wanted the SyncStats of {version}")
    if stats.num_tensors != len(sent):
        raise AssertionError(
            f"send of version {version} reports {stats.num_tensors} tensors, sent {len(sent)}"
        )


def check_destination(h: TransportHarness) -> None:
    """Receivers that offer their own tensors (``receive(into=...)``, as rollouts do, copying
    in what the transport yields elsewhere) end with exactly the sent weights in them."""

    def check(sender: WeightTransport, receivers: _Receivers) -> None:
        sent = h.weights(1)
        sender.send(iter(sent), version=1)
        lines, _ = receivers.results(h.notice_s)
        for rank, per_rank in enumerate(lines, 1):
            if not per_rank:
                raise AssertionError(f"receiver {rank} wrote nothing: {receivers.stderr(rank - 1)}")
            _assert_whole(h, per_rank[0], 1, rank, sent)
            if per_rank[0]["own_digest"] != h.digest(sent):
                raise AssertionError(
                    f"receiver {rank}: the tensors it offered through into= "
                    "do not hold the sent weights after the sync"
                )

    _with_sync(h, [1], check, destination=True)


def check_failing_source(h: TransportHarness) -> None:
    """An export that fails part-way: ``send`` raises ``WeightSyncError`` naming the cause,
    every receiver's ``receive`` raises too (no partial stream taken for a whole one), and the
    next sync over the same connection arrives whole."""

    def broken() -> Iterator[NamedTensor]:
        weights = h.weights(1)
        yield from weights[: len(weights) // 3]
        raise RuntimeError("export failed on the trainer")

    def check(sender: WeightTransport, receivers: _Receivers) -> None:
        try:
            sender.send(broken(), version=1)
        except WeightSyncError as exc:
            if "export failed" not in str(exc):
                raise AssertionError(f"send's error does not name the cause: {exc}") from exc
        else:
            raise AssertionError("send returned although its source raised")
        sent = h.weights(2)
        sender.send(iter(sent), version=2)
        lines, _ = receivers.results(h.notice_s)
        for rank, per_rank in enumerate(lines, 1):
            if not per_rank or "error" not in per_rank[0]:
                raise AssertionError(
                    f"receiver {rank} took the broken version 1 as a whole stream: {per_rank[:1]}"
                )
            if len(per_rank) != 2:
                raise AssertionError(
                    f"receiver {rank} did not receive version 2 after the "
                    f"failed one: {receivers.stderr(rank - 1)}"
                )
            _assert_whole(h, per_rank[1], 2, rank, sent)

    _with_sync(h, [1, 2], check)


def _send_fails(
    h: TransportHarness, sender: WeightTransport, sent: list[NamedTensor], what: str
) -> str:
    """``send`` of ``sent`` must raise ``WeightSyncError`` within ``notice_s`` (a receiver
    ``what``, e.g. died, mid-sync); its message."""
    began = time.monotonic()
    try:
        sender.send(iter(sent), version=1)
    except WeightSyncError as exc:
        said = str(exc)
    else:
        raise AssertionError(f"send reported success although a receiver {what} mid-sync")
    took = time.monotonic() - began
    if took > h.notice_s:
        raise AssertionError(
            f"send noticed the receiver that {what} after {took:.0f} s, over notice_s "
            f"{h.notice_s:.0f}"
        )
    return said


def check_dead_receiver(h: TransportHarness) -> None:
    """A receiver that dies mid-sync fails ``send`` (``WeightSyncError``) and ends the other
    receiver's sync within ``notice_s``, with the transport's deadlines far above: the
    survivor reports an error, or the whole version, never part of it as a success."""
    long = {"timeout_s": 10 * h.notice_s}

    def check(sender: WeightTransport, receivers: _Receivers) -> None:
        sent = h.weights(1)
        _send_fails(h, sender, sent, "died")
        lines, codes = receivers.results(h.notice_s)
        if codes[-1] != DIED:
            raise AssertionError(f"the receiver meant to die exited {codes[-1]}")
        survivor = lines[0][0] if lines[0] else None
        if survivor is None:
            raise AssertionError(f"the surviving receiver wrote nothing: {receivers.stderr(0)}")
        if "error" not in survivor:
            _assert_whole(h, survivor, 1, 1, sent)

    _with_sync(h, [1], check, long, die_after=5)


def check_stuck_receiver(h: TransportHarness) -> None:
    """A receiver that stops mid-sync, alive but silent (SIGSTOP: no abort signal, no closed
    connection), is named by ``send``'s ``WeightSyncError`` within ``notice_s`` when the
    transport's deadline (``timeout_s``) is a third of it; the other receiver ends too, with an
    error or the whole version."""
    short = {"timeout_s": h.notice_s / 3}
    stuck = RECEIVERS  # the last receiver's rank

    def check(sender: WeightTransport, receivers: _Receivers) -> None:
        sent = h.weights(1)
        said = _send_fails(h, sender, sent, "stopped")
        if not re.search(rf"\b(receiver|rank|reader)s? ([\d, ]+, )?{stuck}\b", said):
            raise AssertionError(f"send's error does not name the stuck receiver {stuck}: {said}")
        survivor = receivers.procs[0]
        try:
            survivor.wait(timeout=h.notice_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"receiver 1 was still waiting {h.notice_s:.0f} s after its peer stopped"
            ) from None
        lines = receivers.lines(0)
        if not lines:
            raise AssertionError(f"the other receiver wrote nothing: {receivers.stderr(0)}")
        if "error" not in lines[0]:
            _assert_whole(h, lines[0], 1, 1, sent)

    _with_sync(h, [1], check, short, stop_after=5)


TRANSPORT_CHECKS: dict[str, Callable[[TransportHarness], None]] = {
    "two_syncs": check_two_syncs,
    "destination": check_destination,
    "failing_source": check_failing_source,
    "dead_receiver": check_dead_receiver,
    "stuck_receiver": check_stuck_receiver,
}


TransportCheckResult = KitCheckResult


def run_transport_conformance(h: TransportHarness) -> list[KitCheckResult]:
    """Every check; failures are collected, not raised."""
    return run_checks(TRANSPORT_CHECKS, h)


class TransportConformance(KitConformance):
    """Inherit under pytest and implement :meth:`harness`; each check becomes a test."""

    CHECKS = TRANSPORT_CHECKS
