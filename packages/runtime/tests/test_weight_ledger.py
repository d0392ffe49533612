"""The sender's ledger: what the rollouts hold is trusted only once the sync manager confirms
it, so a failed or unconfirmed sync makes the next one send everything."""

from __future__ import annotations

import torch

from drivetrain.api.weight_sync import SyncStats
from drivetrain.runtime.weight_ledger import WeightLedger


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    return [("frozen", torch.ones(4)), ("trained", torch.full((2,), float(step)))]


def sent(ledger: WeightLedger, version: int, base: int | None, step: int) -> list[str]:
    names = [name for name, _ in ledger.stream(weights(step), version=version, base=base)]
    stats = ledger.stamp(SyncStats(version, len(names), 1, 0, 0.1))
    assert list(stats.fingerprints) == names and stats.skipped == 2 - len(names)
    return names


def test_only_changed_tensors_go_once_the_previous_version_is_confirmed():
    ledger = WeightLedger()
    assert sent(ledger, 1, None, step=1) == ["frozen", "trained"]  # nothing held yet
    assert sent(ledger, 2, 1, step=2) == ["trained"]
    assert sent(ledger, 3, 2, step=2) == []  # unchanged
    assert sent(ledger, 4, 2, step=3) == ["frozen", "trained"]  # 3 was never confirmed
    assert sent(ledger, 5, 4, step=3) == []
    ledger.forget()
    assert sent(ledger, 6, 5, step=3) == ["frozen", "trained"]


def test_without_delta_everything_goes_and_is_still_fingerprinted():
    ledger = WeightLedger(delta=False)
    sent(ledger, 1, None, step=1)
    assert sent(ledger, 2, 1, step=1) == ["frozen", "trained"]
