"""The transport kit: the built-in transports pass it (one sender here, two receiver
processes), and transports broken in one way each are named by it."""

from __future__ import annotations

import pytest
import torch

from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.testing.transport_kit import (
    TRANSPORT_CHECKS,
    TransportConformance,
)
from transport_harness import BroadcastHarness, ColocatedHarness, DiskHarness

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


class TestBroadcast(TransportConformance):
    def harness(self):
        return BroadcastHarness()


class TestColocated(TransportConformance):
    def harness(self):
        return ColocatedHarness()


class TestDisk(TransportConformance):
    def harness(self):
        return DiskHarness()


# ---- planted bugs: the receiving side of the colocated transport, broken ------------------
class _Broken(ColocatedHarness):
    """Receivers whose transport's stream goes through :meth:`receive` (module-level classes:
    the receiver processes import them by name)."""

    @staticmethod
    def receive(plain, into):
        raise NotImplementedError

    def make_transport(self, **overrides):
        transport = super().make_transport(**overrides)
        plain = transport.receive
        transport.receive = lambda into=None: self.receive(plain, into)
        return transport


class SkipsATensor(_Broken):
    @staticmethod
    def receive(plain, into):
        for i, weight in enumerate(plain(into)):
            if i != 3:
                yield weight


class SwallowsAborts(_Broken):
    @staticmethod
    def receive(plain, into):
        try:
            yield from plain(into)
        except WeightSyncError:
            return  # a partial stream, reported as whole


class Reorders(_Broken):
    @staticmethod
    def receive(plain, into):
        yield from reversed([(name, tensor.clone()) for name, tensor in plain(into)])


class WidensBfloat16(_Broken):
    @staticmethod
    def receive(plain, into):
        for name, tensor in plain(into):
            yield name, tensor.float() if tensor.dtype == torch.bfloat16 else tensor


class FlipsAByte(_Broken):
    @staticmethod
    def receive(plain, into):
        flipped = False
        for i, (name, tensor) in enumerate(plain(into)):
            if i >= 5 and tensor.numel() and not flipped:
                flipped = True
                tensor = tensor.clone()  # one value changed, dtype and shape kept
                flat = tensor.view(-1)
                flat[0] = ~flat[0] if tensor.dtype == torch.bool else flat[0] + 1
            yield name, tensor


class ForgetsWhoStopped(ColocatedHarness):
    """A sender that notices a stuck receiver in time but reports only that the sync failed:
    the user cannot tell which rollout to look at."""

    def make_transport(self, **overrides):
        transport = super().make_transport(**overrides)
        plain = transport.send

        def send(weights, *, version):
            try:
                return plain(weights, version=version)
            except WeightSyncError:
                raise WeightSyncError("the weight sync failed") from None

        transport.send = send
        return transport


PLANTED = [
    (SkipsATensor, "two_syncs", r"got 47 tensors of 48 \(missing \['model.half_big.weight'\]\)"),
    (SwallowsAborts, "failing_source", "took the broken version 1 as a whole stream"),
    (Reorders, "two_syncs", "or out of order"),
    (WidensBfloat16, "two_syncs", r"tensor '[\w.]+' arrived as float32, sent as bfloat16"),
    (ForgetsWhoStopped, "stuck_receiver", "does not name the stuck receiver 2"),
    (FlipsAByte, "two_syncs", r"tensor '[\w.]+' arrived with other bytes \(\w+, shape \["),
]


@pytest.mark.parametrize(("broken", "check", "message"), PLANTED)
def test_the_kit_names_a_broken_transport(broken, check, message):
    with pytest.raises(AssertionError, match=message):
        TRANSPORT_CHECKS[check](broken())
