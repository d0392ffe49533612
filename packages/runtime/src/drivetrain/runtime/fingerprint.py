"""Fingerprints of weights: a cheap, exact summary of a tensor's bytes, equal on every device
for equal bytes. The trainer records one per tensor it sends; a rollout reports its own for
the same names after a sync (provenance: it serves what was sent), and the sender skips a
tensor whose fingerprint the rollouts already hold (delta updates).

A fingerprint reads ``"<dtype>:<kind>:<hex>"``. ``kind`` is how the bytes were summarised,
picked by where the sender's tensor lives, so that neither side copies the weights to check
them in the common case:

- ``crc32`` (CPU tensors): zlib's CRC-32 of the bytes, about 4 GB/s on one core here;
- ``isum`` (accelerator tensors): the bytes, zero-padded to 8, as little-endian 64-bit words
  ``w_i``, summarised as ``sum(w_i)`` and ``sum(w_i * (2i + 1))`` modulo 2**64: integer sums,
  exact and independent of the reduction order, one pass over device memory.

The other side computes the same kind whatever its device (a slower path, never a wrong one),
on its tensor cast to the sender's dtype: a rollout that keeps float32 copies of bfloat16
weights matches, one that rounded them through float16 does not. Neither is a cryptographic
hash (``weight_sync.verify`` is): they catch stale, missing, perturbed, cast or transposed
weights, not an adversary. torch is imported when a fingerprint is taken (this package
installs with the standard library alone).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KINDS = ("crc32", "isum")
_MASK = (1 << 64) - 1


def kind_for(tensor: torch.Tensor) -> str:
    """The kind that summarises ``tensor`` where it lives."""
    return "crc32" if tensor.device.type == "cpu" else "isum"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    import torch

    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _isum_terms(data: torch.Tensor) -> torch.Tensor:
    """The two ``isum`` sums of ``data``'s bytes, on its device, not yet read."""
    import torch

    pad = -data.numel() % 8
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int64)
    odd = torch.arange(words.numel(), dtype=torch.int64, device=words.device) * 2 + 1
    return torch.stack([words.sum(), (words * odd).sum()])


def _hex(sums: list[int]) -> str:
    return "".join(f"{value & _MASK:016x}" for value in sums)


def _digest(tensor: torch.Tensor, kind: str) -> str:
    data = _bytes(tensor)
    if kind == "crc32":
        host = data.cpu() if data.device.type != "cpu" else data
        return f"{zlib.crc32(memoryview(host.numpy())):08x}"
    if kind == "isum":
        return _hex(_isum_terms(data).tolist())  # one device sync
    raise ValueError(f"unknown fingerprint kind {kind!r}; known: {', '.join(KINDS)}")


def fingerprint(tensor: torch.Tensor, kind: str | None = None) -> str:
    """``tensor``'s fingerprint (``"<dtype>:<kind>:<hex>"``), of ``kind`` or the one for
    where it lives."""
    kind = kind or kind_for(tensor)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{dtype}:{kind}:{_digest(tensor, kind)}"


def fingerprint_all(tensors: Sequence[torch.Tensor], kind: str | None = None) -> list[str]:
    """:func:`fingerprint` of each tensor, the ``isum`` ones read from the device together:
    one device sync for all of them instead of one per tensor, each of which would stall the
    sender's pipeline."""
    import torch

    kinds = [kind or kind_for(tensor) for tensor in tensors]
    summed = [i for i, k in enumerate(kinds) if k == "isum"]
    sums: list[list[int]] = []
    if summed:
        terms = [_isum_terms(_bytes(tensors[i])) for i in summed]
        if len({term.device for term in terms}) > 1:  # one stack, one device
            terms = [term.cpu() for term in terms]
        sums = torch.stack(terms).tolist()
    out = []
    by_index = dict(zip(summed, sums, strict=True))
    for i, tensor in enumerate(tensors):
        digest = _hex(by_index[i]) if i in by_index else _digest(tensor, kinds[i])
        out.append(f"{str(tensor.dtype).removeprefix('torch.')}:{kinds[i]}:{digest}")
    return out


def fingerprint_like(
    weights: Mapping[str, torch.Tensor], expected: Mapping[str, str]
) -> dict[str, str]:
    """Fingerprints of ``weights`` for the names of ``expected``, each of its dtype and kind
    (what a rollout reports for provenance); a name ``weights`` lacks maps to ``"missing"``."""
    import torch

    out: dict[str, str] = {}
    with torch.no_grad():
        for name, want in expected.items():
            tensor = weights.get(name)
            if tensor is None:
                out[name] = "missing"
                continue
            dtype_name, kind, _ = want.split(":", 2)
            dtype = getattr(torch, dtype_name, None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"fingerprint of {name!r} names no torch dtype: {want!r}")
            out[name] = fingerprint(tensor if tensor.dtype == dtype else tensor.to(dtype), kind)
    return out


def first_difference(
    expected: Mapping[str, str], actual: Mapping[str, str]
) -> tuple[str, str, str] | None:
    """The first name (in ``expected``'s order) whose fingerprint differs, with both
    fingerprints; ``None`` when all agree."""
    for name, want in expected.items():
        got = actual.get(name, "missing")
        if got != want:
            return name, want, got
    return None


def fingerprints(weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Every tensor's fingerprint, by name (each of the kind for where it lives)."""
    return {name: fingerprint(tensor) for name, tensor in weights}
