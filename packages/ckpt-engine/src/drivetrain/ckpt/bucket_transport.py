"""The part of ``broadcast`` and ``colocated`` that is the same: send and receive over the
bucket pipeline; each subclass says only how its links are made and what a broken one costs."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator

import torch

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import Destination, SyncStats, WeightTransport
from drivetrain.ckpt.buckets import Layouts
from drivetrain.ckpt.pipeline import (
    ReceiverLink,
    SenderLink,
    receive_stream,
    send_stream,
)


class BucketTransport(WeightTransport):
    device: torch.device = torch.device("cpu")
    _layouts: Layouts | None = None

    @property
    def layouts(self) -> Layouts:
        """The bucket layouts of this transport's buffers, kept from sync to sync."""
        if self._layouts is None:
            self._layouts = Layouts()
        return self._layouts

    @abc.abstractmethod
    def _sender_link(self) -> SenderLink:
        """A link for one sync; raises :class:`WeightSyncError` when not connected to send."""

    @abc.abstractmethod
    def _receiver_link(self) -> ReceiverLink:
        """A link for one sync; raises :class:`WeightSyncError` when not connected to receive."""

    def _on_broken(self) -> None:
        """Called after a sync whose link broke (a peer died), at either end: make the next
        use reconnect."""

    def send(self, weights: Iterable[NamedTensor], *, version: int) -> SyncStats:
        link = self._sender_link()
        try:
            return send_stream(
                link,
                weights,
                version=version,
                verify=self.config.verify,
                layouts=self.layouts,
            )
        finally:
            if getattr(link, "broken", False):
                self.layouts.clear()  # the next link may map other buffers
                self._on_broken()

    def receive(self, into: Destination | None = None) -> Iterator[NamedTensor]:
        link = self._receiver_link()  # "not connected" raises here, not at the first tensor
        return self._receiving(link, into)

    def _receiving(self, link: ReceiverLink, into: Destination | None) -> Iterator[NamedTensor]:
        try:
            yield from receive_stream(
                link,
                device=self.device,
                verify=self.config.verify,
                timeout_s=self.config.deadline_s(link.buffers[0].numel()),  # one bucket
                on_stats=self._record,
                into=into,
                layouts=self.layouts,
            )
        finally:
            if getattr(link, "broken", False):
                self.layouts.clear()  # the next link may map other buffers
                self._on_broken()

    def _record(self, stats: SyncStats) -> None:
        self.last_stats = stats
