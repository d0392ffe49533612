"""The weight-sync (ckpt-engine) contract: moving an engine's weight stream into rollouts.

One sync, as the trainer's manager runs it::

    endpoint = sender.prepare()                       # trainer rank 0, once
    topology = Topology.one_sender(num_receivers)     # or a transport's own layout
    sender.connect(TransportRole.SENDER, 0, topology, endpoint)      # once, reused
    receiver_i.connect(TransportRole.RECEIVER, i + 1, topology, endpoint)
    # every step, sender and receivers at once (threads or processes):
    stats = sender.send(engine.export_weights(), version=step)  ‖
    rollout_i.update_weights(receiver_i.receive(into=rollout_i.weight_destination),
                             version=step)
    ...
    transport.finalize()

Transports bucket tensors (``WeightSyncConfig.bucket_bytes``, never hard-coded), send each
bucket's metadata ahead of its data, split tensors larger than a bucket and rejoin them, and
raise :class:`WeightSyncError` within ``timeout_s`` when a peer disappears instead of hanging.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.errors import DrivetrainError

#: ``into(name, shape, dtype_name)``: the receiving side's own tensor for a weight (the same
#: shape and dtype), or ``None``. See :meth:`WeightTransport.receive`.
Destination = Callable[[str, tuple[int, ...], str], Any]


class WeightSyncError(DrivetrainError):
    """A sync failed (peer died, timeout, mismatched metadata); no receiver reports success."""


class TransportRole(enum.Enum):
    SENDER = "sender"
    RECEIVER = "receiver"


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver learns about a tensor before its bytes arrive."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "bfloat16"
    nbytes: int


@dataclass(frozen=True)
class Topology:
    """Ranks of the transport's own group: which senders and receivers take part.

    ``senders`` and ``receivers`` are transport-group ranks; ``world_size`` counts both.
    """

    senders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.senders) + len(self.receivers)

    @classmethod
    def one_sender(cls, num_receivers: int) -> Topology:
        """Trainer rank 0 sends (rank 0); rollout worker ``i`` receives as rank ``i + 1``."""
        if num_receivers < 1:
            raise ValueError(f"need at least one receiver, got {num_receivers}")
        return cls(senders=(0,), receivers=tuple(range(1, num_receivers + 1)))


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved and how long it took, as seen by the reporting side.

    ``digest`` is the hash of every name, dtype, shape and byte moved when the transport's
    ``verify`` is on (equal at both ends, or the receiver refused the stream), else ``None``.
    The sender's side also carries, when it keeps a ledger of what the receivers hold
    (``weight_sync.delta`` / ``provenance``): ``fingerprints``, by name, of the tensors this
    sync moved (:mod:`drivetrain.runtime.fingerprint`), and the tensors and bytes it left out
    because every receiver already held them (``skipped``, ``skipped_bytes``).
    """

    version: int
    num_tensors: int
    num_buckets: int
    bytes: int
    seconds: float
    digest: str | None = None
    fingerprints: Mapping[str, str] | None = None
    skipped: int = 0
    skipped_bytes: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class WeightTransport(abc.ABC):
    """Base class of every weight-sync transport (entry-point group ``drivetrain.ckpt_engines``)."""

    config: WeightSyncConfig
    #: The receiving transport itself sets it, inside :meth:`receive`, after the stream's
    #: last tensor was yielded and the whole stream verified (before the generator ends): the
    #: sync's version, tensor count, bytes and digest. The trainer's receiving end
    #: (``runtime.weight_receiver``) clears it before each sync and fails the sync if the
    #: stream ends without it or with another version; the transport kit compares it with
    #: what was sent.
    last_stats: SyncStats | None

    def __init__(self, config: WeightSyncConfig) -> None:
        self.config = config
        self.last_stats = None

    @abc.abstractmethod
    def prepare(self) -> Mapping[str, Any]:
        """On the sending side, before anyone connects: reserve what peers need to reach it
        (an address and free port, a shared directory, an IPC handle) and return it as
        JSON-serialisable data for the controller to hand to every participant."""

    @abc.abstractmethod
    def connect(
        self, role: TransportRole, rank: int, topology: Topology, endpoint: Mapping[str, Any]
    ) -> None:
        """Join the transport group once (collective over all participants); reused by every
        later sync until :meth:`finalize`."""

    @abc.abstractmethod
    def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        """Send the whole stream to every receiver (blocking). Returns when every receiver has
        the last bucket; raises :class:`WeightSyncError` within the deadline if one does not."""

    @abc.abstractmethod
    def receive(self, into: Destination | None = None) -> Iterator[NamedTensor]:
        """Yield the tensors of one sync (blocking), in the sender's order, as full tensors
        with the sender's names, shapes and dtypes, ending when the sender's stream ends. A
        yielded tensor may be a view of the transport's buffers, valid until the next one is
        requested (as with an engine's export): consumers copy what they keep. Raises
        :class:`WeightSyncError` before the end if the stream is incomplete or fails
        verification (an all-or-nothing consumer stages what it got and applies nothing).

        ``into`` lets a transport skip a copy: for any tensor it may ask ``into(name,
        shape, dtype)`` for the consumer's own tensor, write the bytes (or the pieces of a
        split tensor, as they arrive) there, and yield that tensor itself, which the consumer
        then need not copy (the built-in transports apply a whole bucket so, in one batched
        copy). Such a consumer's weights change before the stream ends. A whole stream
        sets :attr:`last_stats` before the generator ends."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Leave the group and free buffers; idempotent."""


def drain(weights: Iterable[NamedTensor]) -> int:
    """Consume a weight stream without sending it (engine ranks that take part in the export's
    collectives but do not send); returns the number of tensors."""
    return sum(1 for _ in weights)
