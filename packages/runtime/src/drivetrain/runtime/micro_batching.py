"""The micro-batch driver every distributed engine needs, written once against a protocol.

An SPMD engine cuts its shard of a mini-batch into micro-batches itself, but its ranks must
agree on two things before any forward pass: the mini-batch's global loss-token and sequence
counts (the :class:`~drivetrain.api.loss.LossContext` every loss divides by) and the number of
micro-batches (each forward and backward runs collectives, so a rank with fewer micro-batches
pads with loss-free ones). When one rank cannot cut its shard (a sample longer than the token
budget), the others must not be left waiting in a collective: every rank raises the same
:class:`BatchError`, naming the rank and its cause.

The driver is stdlib-only. The engine supplies its collectives through :class:`Collectives`
(drivetrain-engine-core implements it over ``torch.distributed``; a third-party engine on
another library implements three methods)::

    totals = loss_totals(batch, collectives)            # raises if no token has loss_mask 1
    for indices in plan_micro_batches(batch, config.micro_batch, collectives):
        micro = batch.select(indices) if indices else <a loss-free dummy>
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from drivetrain.api.batch import Batch, Layout
from drivetrain.api.column_ops import column_ops_for
from drivetrain.api.columns import LOSS_MASK
from drivetrain.api.config import MicroBatchConfig
from drivetrain.api.errors import BatchError


class Collectives(Protocol):
    """The three reductions the driver needs, over the engine's process group. Every rank calls
    them in the same order (they are collectives)."""

    def max_ints(self, values: Sequence[int]) -> list[int]:
        """The element-wise maximum of ``values`` over every rank of the engine."""
        ...

    def sum_over_data_parallel(self, values: Sequence[float]) -> list[float]:
        """The element-wise sum of ``values`` over the data-parallel ranks (ranks that hold the
        same data, e.g. tensor- or sequence-parallel peers, count once). Exact for integers up
        to 2**53 (reduce in float64)."""
        ...

    def gather_texts(self, text: str) -> list[str]:
        """Every rank's ``text``, in rank order (only used on the failure path)."""
        ...


@dataclass(frozen=True)
class LossTotals:
    """The mini-batch's counts over every data-parallel rank."""

    tokens: int  # tokens with loss_mask 1
    sequences: int


def local_loss_tokens(batch: Batch) -> float:
    """How many of the shard's real tokens have ``loss_mask`` set (padding never counts)."""
    if not len(batch):
        return 0.0
    mask: Any = batch[LOSS_MASK]
    if batch.layout is Layout.PADDED:
        ops = column_ops_for(mask)
        if ops.pack is None:
            raise BatchError(f"column {LOSS_MASK!r}: its type cannot change layout")
        mask = ops.pack(mask, batch.seq_lens)
    return float(mask.sum()) if hasattr(mask, "sum") else float(sum(mask))


def loss_totals(batch: Batch, collectives: Collectives) -> LossTotals:
    """Global loss-token and sequence counts; the same :class:`BatchError` on every rank when
    no token of the whole mini-batch has ``loss_mask`` set, or when one rank cannot count its
    shard's (no ``loss_mask`` column, a type that cannot change layout)."""
    error: Exception | None = None
    local = 0.0
    try:
        local = local_loss_tokens(batch)
    except (BatchError, KeyError, TypeError, ValueError) as exc:  # the peers are told below
        error = exc
    # the failure flag rides along: every data-parallel group holds a copy of every shard,
    # so a failing shard raises its flag in every group
    tokens, sequences, failed = collectives.sum_over_data_parallel(
        [local, float(len(batch)), float(error is not None)]
    )
    if failed:
        _raise_everywhere(collectives, error, "could not count its shard's loss tokens")
    if tokens == 0:
        raise BatchError("the mini-batch has no tokens with loss_mask == 1")
    return LossTotals(int(tokens), int(sequences))


def _raise_everywhere(collectives: Collectives, error: Exception | None, what: str) -> None:
    """Raise, on every rank, the same BatchError naming the first failed rank and its cause."""
    mine = ""
    if error is not None:
        mine = str(error) if isinstance(error, BatchError) else f"{type(error).__name__}: {error}"
        mine = mine or type(error).__name__
    texts = collectives.gather_texts(mine)
    rank, text = next((r, t) for r, t in enumerate(texts) if t)
    raise BatchError(f"rank {rank} {what}: {text}") from error


def _cut(batch: Batch, spec: MicroBatchConfig) -> list[list[int]]:
    if spec.max_tokens is not None:
        return batch.token_budget_parts(spec.max_tokens)
    return batch.fixed_size_parts(spec.micro_batch_size or 1)


def plan_micro_batches(
    batch: Batch, spec: MicroBatchConfig, collectives: Collectives
) -> list[list[int]]:
    """Sample-index groups, one per micro-batch, the same count on every rank: a short shard
    is spread over the agreed count when its token budget allows, else padded with empty
    groups (run them as loss-free dummies). Samples of one ``sample_group`` stay together."""
    error: BatchError | None = None
    parts: list[list[int]] = []
    try:
        parts = _cut(batch, spec)
    except BatchError as exc:  # tell the peers before raising, or they wait forever
        error = exc
    count, failed = collectives.max_ints([len(parts), int(error is not None)])
    if failed:
        _raise_everywhere(collectives, error, "could not cut its shard into micro-batches")
    # units, not samples: a sample_group is never split, so a shard of fewer groups than the
    # agreed count cannot be spread over it (it pads with empty micro-batches)
    if spec.max_tokens is not None and len(parts) < count <= len(batch.units()):
        balanced = batch.token_budget_parts(spec.max_tokens, min_parts=count)
        if len(balanced) == count:  # spread over the agreed count rather than pad
            parts = balanced
    return parts + [[] for _ in range(count - len(parts))]
