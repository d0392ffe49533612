"""The transport kit: the built-in transports pass it (one sender here, two receiver
processes), and transports broken in one way each are named by it."""

from __future__ import annotations

import pytest

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


PLANTED = [
    (SkipsATensor, "two_syncs", r"got 47 tensors of 48 \(missing \['model.half_big.weight'\]\)"),
    (SwallowsAborts, "failing_source", "took the broken version 1 as a whole stream"),
    (Reorders, "two_syncs", "or out of order"),
]


@pytest.mark.parametrize(("broken", "check", "message"), PLANTED)
def test_the_kit_names_a_broken_transport(broken, check, message):
    with pytest.raises(AssertionError, match=message):
        TRANSPORT_CHECKS[check](broken())
