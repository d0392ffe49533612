"""The sender's ledger: what the rollouts hold is trusted only once the sync manager confirms
it, so a failed or unconfirmed sync makes the next one send everything."""

from __future__ import annotations

import torch

from drivetrain.api.weight_sync import SyncStats
from drivetrain.runtime.weight_ledger import WeightLedger, delta_unit


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


def test_a_changed_tensor_takes_its_whole_layer_along():
    """vLLM fuses q/k/v (and gate/up) into one tensor and rebuilds it from every part: a
    ``q_proj`` sent alone left the rest of the fused tensor uninitialized there."""
    layer = ("q_proj", "k_proj", "v_proj", "o_proj")

    def model(q: float) -> list[tuple[str, torch.Tensor]]:
        names = [f"model.layers.{i}.self_attn.{p}.weight" for i in (0, 1) for p in layer]
        tensors = [("model.embed_tokens.weight", torch.zeros(3))]
        tensors += [(n, torch.full((2,), q if n.endswith("0.self_attn.q_proj.weight") else 1.0))
                    for n in names]  # fmt: skip
        return [*tensors, ("model.norm.weight", torch.ones(2))]

    ledger = WeightLedger()
    assert len(list(ledger.stream(model(0.0), version=1, base=None))) == 10
    moved = [name for name, _ in ledger.stream(model(5.0), version=2, base=1)]
    assert moved == [f"model.layers.0.self_attn.{p}.weight" for p in layer]
    assert ledger.stamp(SyncStats(2, 4, 1, 0, 0.1)).skipped == 6
    assert delta_unit("model.layers.3.mlp.experts.7.w1") == "model.layers.3"
    assert delta_unit("model.norm.weight") == "model.norm" and delta_unit("frozen") == "frozen"
