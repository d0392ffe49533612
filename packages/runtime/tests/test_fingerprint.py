"""Fingerprints: equal bytes give equal fingerprints on either summary, any changed value,
order, dtype or shape does not, and a rollout's check casts to the sender's dtype."""

from __future__ import annotations

import pytest
import torch

from drivetrain.runtime.fingerprint import (
    fingerprint,
    fingerprint_all,
    fingerprint_like,
    first_difference,
)


@pytest.mark.parametrize("kind", ["crc32", "isum"])
def test_a_fingerprint_sees_a_changed_value_order_or_cast(kind):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 7, generator=g).to(torch.bfloat16)
    mark = fingerprint(weight, kind)
    assert mark.startswith(f"bfloat16:{kind}:") and fingerprint(weight.clone(), kind) == mark
    nudged = weight.clone()
    nudged[13, 2] = nudged[13, 2] + 1
    transposed = weight.reshape(7, 40).t().contiguous().reshape(40, 7)  # same values, moved
    for other in (nudged, transposed, weight.to(torch.float16)):
        assert fingerprint(other, kind) != mark
    odd = torch.arange(5, dtype=torch.uint8)  # not a multiple of 8 bytes
    assert fingerprint(odd, kind) != fingerprint(torch.arange(6, dtype=torch.uint8)[:5] + 1, kind)


def test_the_isum_of_an_accelerator_equals_the_cpus_for_the_same_bytes():
    """The sums are modulo 2**64 and exact: any device, any reduction order, same value
    (checked here against Python integers)."""
    words = torch.tensor([2**62, -(2**61), 12345, -1], dtype=torch.int64)
    (plain, weighted) = (int(fingerprint(words, "isum")[-32:][i : i + 16], 16) for i in (0, 16))
    values = [2**62, -(2**61), 12345, -1]
    assert plain == sum(values) % 2**64
    assert weighted == sum(v * (2 * i + 1) for i, v in enumerate(values)) % 2**64


def test_a_rollout_checks_its_weights_in_the_senders_dtype():
    sent = torch.randn(16, 4).to(torch.bfloat16)
    expected = {"w": fingerprint(sent), "b": fingerprint(torch.zeros(3))}
    kept_in_fp32 = {"w": sent.float(), "b": torch.zeros(3)}
    assert first_difference(expected, fingerprint_like(kept_in_fp32, expected)) is None
    lost = {"w": sent.float()}
    assert first_difference(expected, fingerprint_like(lost, expected)) == (
        "b", expected["b"], "missing"
    )  # fmt: skip
    with pytest.raises(ValueError, match="names no torch dtype"):
        fingerprint_like(kept_in_fp32, {"w": "nonsense:crc32:00"})


def test_fingerprints_taken_together_equal_each_taken_alone():
    """The ledger fingerprints a layer at once (one device sync for its ``isum`` sums)."""
    g = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(5, 3, generator=g).to(torch.bfloat16),
        torch.randn(7, generator=g),
        torch.arange(5, dtype=torch.uint8),  # not a multiple of 8 bytes
        torch.randn(4, 4, generator=g).t(),  # not contiguous
    ]
    for kind in ("isum", "crc32", None):
        assert fingerprint_all(tensors, kind) == [fingerprint(t, kind) for t in tensors]
    assert fingerprint_all([]) == []
