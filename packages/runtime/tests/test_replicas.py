"""One replica policy for every caller: contiguous chunks, sizes within one of each other."""

import pytest

from drivetrain.runtime.replicas import Slot, replica_slots


def test_one_replica_takes_everything_from_the_first_item():
    assert replica_slots(3, 1) == [Slot(0, 0)] * 3


def test_items_are_cut_into_contiguous_even_chunks():
    slots = replica_slots(7, 3)
    assert [s.replica for s in slots] == [0, 0, 0, 1, 1, 2, 2]
    assert [s.first for s in slots] == [0, 0, 0, 3, 3, 5, 5]


def test_fewer_items_than_replicas_use_the_first_replicas_once():
    assert replica_slots(2, 4) == [Slot(0, 0), Slot(1, 1)]
    assert replica_slots(0, 4) == []


def test_no_replica_is_refused():
    with pytest.raises(ValueError, match="at least one rollout replica"):
        replica_slots(3, 0)
