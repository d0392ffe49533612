"""The double-buffered send and receive loops every bucket transport shares.

A transport supplies a *link*: two bucket buffers and how to move one to the receivers. The
sender packs bucket N+1 into one buffer while bucket N is still moving out of the other; the
receiver's link runs in a background thread, filling one buffer while the consumer copies
tensors out of the other. Errors, timeouts and aborts surface as :class:`WeightSyncError`.

Copies into and out of the buffers are queued on the device's current stream; the link
orders them against the other side's (``post``, ``ready``, ``release``), by waiting on the
host or, where it can, on the device alone. The receiver waits for its device once, before it
confirms the stream.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import Destination, SyncStats, WeightSyncError
from drivetrain.ckpt.buckets import (
    Layouts,
    Reassembler,
    StreamDigest,
    pack,
    plan_buckets,
)
from drivetrain.ckpt.devices import synchronize


class SenderLink(Protocol):
    buffers: list[torch.Tensor]

    def post(self, index: int, header: dict[str, Any]) -> None:
        """Start moving ``buffers[index]`` (header first) to every receiver, once the copies
        queued into it are done."""

    def wait(self, index: int) -> None:
        """Return once every receiver is done with ``buffers[index]``."""

    def finish(self, summary: dict[str, Any]) -> None:
        """Send the end of the stream; return once every receiver confirmed all of it."""

    def abort(self, reason: str) -> None:
        """Tell the receivers the stream failed (best effort)."""


class ReceiverLink(Protocol):
    buffers: list[torch.Tensor]
    #: Whether :meth:`next` moves the bucket's bytes itself (a collective: run in a thread,
    #: filling one buffer while the consumer empties the other) or only reads a notice that
    #: they are there (shared memory: called inline, a thread would only add hand-offs).
    read_ahead: bool

    def next(self) -> tuple[str, dict[str, Any], int]:
        """Block for the next message: ``("bucket", header, buffer_index)`` once its bytes
        are in ``buffers[buffer_index]``, or ``("end", summary, -1)``."""

    def ready(self, index: int) -> None:
        """Order the consumer's reads of ``buffers[index]`` after its bytes' arrival. Called
        on the consumer's thread, whose current stream the reads go to (:meth:`next` may run
        on another)."""

    def release(self, index: int) -> None:
        """The consumer's reads of ``buffers[index]`` are queued: the sender may refill it
        once they are done."""

    def confirm(self, ok: bool, detail: str) -> None:
        """Report the whole stream received and verified (or not) to the sender."""


def send_stream(
    link: SenderLink,
    weights: Iterable[NamedTensor],
    *,
    version: int,
    verify: bool,
    layouts: Layouts | None = None,
) -> SyncStats:
    """Stream ``weights`` through the link's two buffers (``layouts``: the buckets' views in
    them kept from earlier syncs, see :class:`~drivetrain.ckpt.buckets.Layouts`)."""
    start = time.perf_counter()
    layouts = layouts or Layouts()
    digest = StreamDigest() if verify else None
    bucket_bytes = link.buffers[0].numel()
    in_flight = [False, False]
    index = num_tensors = num_buckets = total_bytes = 0
    finishing = False
    try:
        for bucket in plan_buckets(weights, bucket_bytes):
            if in_flight[index]:
                link.wait(index)
            buffer = link.buffers[index]
            layout = pack(bucket, buffer, layouts)
            pieces = layout.pieces
            if digest is not None:
                for piece in pieces:
                    digest.update(piece, buffer[piece.offset : piece.offset + piece.nbytes])
            header = {"version": version, "pieces": layout.text, "nbytes": layout.used}
            link.post(index, header)
            in_flight[index] = True
            index ^= 1
            num_buckets += 1
            num_tensors += layout.completes
            total_bytes += layout.nbytes
        for i in (0, 1):
            if in_flight[i]:
                link.wait(i)
        summary = {
            "version": version,
            "num_tensors": num_tensors,
            "num_buckets": num_buckets,
            "bytes": total_bytes,
            "digest": digest.hexdigest() if digest is not None else None,
        }
        finishing = True  # every bucket is out: a failure now is the receivers' verdict,
        link.finish(summary)  # and an abort would only pair with their next sync's messages
    except WeightSyncError as exc:
        if not finishing:
            link.abort(str(exc))
        raise
    except BaseException as exc:
        if not finishing:
            link.abort(f"{type(exc).__name__}: {exc}")
        if isinstance(exc, Exception):
            raise WeightSyncError(f"sending version {version} failed: {exc}") from exc
        raise
    return SyncStats(
        version,
        num_tensors,
        num_buckets,
        total_bytes,
        time.perf_counter() - start,
        summary["digest"],
    )


def _read_ahead(link: ReceiverLink, out: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        while not stop.is_set():
            message = link.next()
            out.put(message)
            if message[0] == "end":
                return
    except BaseException as exc:  # handed to the consumer, raised there
        out.put(exc)


class _Messages:
    """A link's messages, read in a background thread when the link reads ahead, else
    inline; each failure (or silence) as a :class:`WeightSyncError`."""

    def __init__(self, link: ReceiverLink, timeout_s: float) -> None:
        self.link, self.timeout_s = link, timeout_s
        self.stop = threading.Event()
        self.queue: queue.Queue[Any] | None = None
        if link.read_ahead:
            self.queue = queue.Queue()
            threading.Thread(
                target=_read_ahead,
                args=(link, self.queue, self.stop),
                name="weight-sync-recv",
                daemon=True,
            ).start()

    def next(self) -> tuple[str, Any, Any]:
        if self.queue is None:
            try:
                message: Any = self.link.next()
            except Exception as exc:
                message = exc
        else:
            try:
                message = self.queue.get(timeout=self.timeout_s)
            except queue.Empty:
                raise WeightSyncError(f"no weight-sync data for {self.timeout_s:.0f} s") from None
        if isinstance(message, WeightSyncError):
            raise message
        if isinstance(message, BaseException):
            raise WeightSyncError(f"receiving failed: {message}") from message
        return message


def _confirm_end(
    link: ReceiverLink, header: dict[str, Any], mine: dict[str, Any], verify: bool
) -> None:
    """Compare what arrived (``mine``) with the end header; confirm to the sender either way,
    raise on a mismatch."""
    wrong = {k: (v, header.get(k)) for k, v in mine.items() if v != header.get(k)}
    if verify and header.get("digest") is None:
        wrong["digest"] = (mine["digest"], "not sent (the sender does not verify)")
    if not verify:
        wrong.pop("digest", None)
    if wrong:
        detail = ", ".join(f"{k}: received {a}, sent {b}" for k, (a, b) in wrong.items())
        link.confirm(False, detail)
        raise WeightSyncError(f"weight stream version {header['version']} differs: {detail}")
    link.confirm(True, "")


def receive_stream(
    link: ReceiverLink,
    *,
    device: torch.device,
    verify: bool,
    timeout_s: float,
    on_stats: Callable[[SyncStats], None],
    into: Destination | None = None,
    layouts: Layouts | None = None,
) -> Iterator[NamedTensor]:
    """Yield one sync's tensors; ``on_stats`` gets its statistics after the end was verified.
    Raises :class:`WeightSyncError` (before the end) on abort, timeout, or a mismatch. A
    tensor goes straight into ``into``'s tensor when it names one."""
    start = time.perf_counter()
    layouts = layouts or Layouts()
    messages = _Messages(link, timeout_s)
    rebuild = Reassembler(device, into)
    digest = StreamDigest() if verify else None
    num_buckets = total_bytes = 0
    completed = False
    try:
        while True:
            kind, header, index = messages.next()
            if kind == "end":
                break
            buffer = link.buffers[index]
            link.ready(index)
            layout = layouts.receiving(header["pieces"], buffer)
            if digest is not None:
                for piece in layout.pieces:
                    digest.update(piece, buffer[piece.offset : piece.offset + piece.nbytes])
            total_bytes += layout.nbytes
            yield from rebuild.add_bucket(layout)
            link.release(index)
            num_buckets += 1
        rebuild.check_complete()
        synchronize(device)  # the tensors are in place before the sender hears they are
        mine = {
            "num_tensors": rebuild.completed,
            "num_buckets": num_buckets,
            "bytes": total_bytes,
            "digest": digest.hexdigest() if digest is not None else None,
        }
        _confirm_end(link, header, mine, verify)
        seconds = time.perf_counter() - start
        on_stats(
            SyncStats(
                header["version"],
                rebuild.completed,
                num_buckets,
                total_bytes,
                seconds,
                mine["digest"],
            )
        )
        completed = True
    finally:
        messages.stop.set()
        if not completed:  # unblock and drop the reader: this stream is over either way
            # and no copy of it still reads a buffer the next one fills (a device that fails
            # here has failed already: that error is the one to see)
            with contextlib.suppress(Exception):
                synchronize(device)
            close = getattr(link, "close", None)
            if close is not None:
                close()
