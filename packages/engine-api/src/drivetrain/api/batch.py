"""The batch container every drivetrain component exchanges.

A :class:`Batch` holds named columns of ``len(batch)`` samples, the true token length of every
sample, typed metadata and a layout:

* ``PADDED``: every column's first dimension is the sample; token columns are ``[n, T, ...]``,
  right-padded (sample ``i`` occupies positions ``0 .. seq_lens[i]-1``).
* ``PACKED`` ("remove padding"): token columns are flat ``[sum(seq_lens), ...]``; sample ``i``
  occupies ``offsets[i] : offsets[i+1]``. Per-sample columns keep the sample as first dimension.

Which columns are per token is recorded in ``token_keys``. Column values are opaque (tensors,
arrays, lists); :mod:`drivetrain.api.column_ops` says how to index and join each type. Every
operation returns a new batch; nothing is modified in place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate, pairwise
from types import MappingProxyType
from typing import Any

from drivetrain.api.column_ops import column_ops_for
from drivetrain.api.columns import SAMPLE_GROUP
from drivetrain.api.errors import BatchError
from drivetrain.api.partition import (
    balanced_partition,
    chunk_sizes,
    dp_shard_indices,
    expand_units,
    inverse_permutation,
    sample_units,
    token_budget_partition,
)


class Layout(enum.Enum):
    PADDED = "padded"
    PACKED = "packed"


@dataclass(frozen=True)
class BatchMeta:
    """Typed facts about the whole batch. Per-sample facts belong in columns.

    Extend by subclassing (a frozen dataclass) rather than adding string keys.
    """

    pad_token_id: int = 0
    step: int | None = None  # the trainer step that produced this batch
    weight_version: int | None = None  # weights the batch was generated with, if uniform


def _merge_meta(batches: Sequence[Batch]) -> BatchMeta:
    """Fields all batches agree on are kept; optional ones that differ (e.g. the weight version
    of samples from several rollouts) become ``None``; others must agree."""
    first = batches[0].meta
    changes = {}
    for f in fields(first):
        values = {getattr(b.meta, f.name) for b in batches}
        if len(values) > 1:
            if f.default is not None:
                raise BatchError(f"cannot concat batches whose meta.{f.name} differ: {values}")
            changes[f.name] = None
    return replace(first, **changes) if changes else first


def restore_order(pieces: Sequence[Batch], indices: Sequence[Sequence[int]]) -> Batch:
    """Join pieces that hold the samples at ``indices`` of some batch (e.g. data-parallel
    shards from :func:`drivetrain.api.partition.dp_shard_indices`) back into that batch's order."""
    flat = [i for group in indices for i in group]
    return Batch.concat(list(pieces)).select(inverse_permutation(flat))


@dataclass(frozen=True)
class Batch:
    columns: Mapping[str, Any]
    seq_lens: tuple[int, ...]
    token_keys: frozenset[str] = frozenset()
    layout: Layout = Layout.PADDED
    meta: BatchMeta = field(default_factory=BatchMeta)

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", MappingProxyType(dict(self.columns)))
        object.__setattr__(self, "seq_lens", tuple(int(n) for n in self.seq_lens))
        object.__setattr__(self, "token_keys", frozenset(self.token_keys))
        unknown = self.token_keys - set(self.columns)
        if unknown:
            raise BatchError(f"token_keys {sorted(unknown)} are not columns {sorted(self.columns)}")
        if any(n < 0 for n in self.seq_lens):
            raise BatchError("seq_lens must be non-negative")
        for name, value in self.columns.items():
            want = self.num_tokens if self._is_flat(name) else len(self.seq_lens)
            have = column_ops_for(value).length(value)
            if have != want:
                unit = "tokens (packed)" if self._is_flat(name) else "samples"
                raise BatchError(f"column {name!r} has {have} rows, expected {want} {unit}")

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, Any],
        *,
        seq_lens: Sequence[int],
        token_keys: Iterable[str] | None = None,
        layout: Layout = Layout.PADDED,
        meta: BatchMeta | None = None,
    ) -> Batch:
        """Build a batch; ``token_keys`` defaults to the standard token columns present."""
        from drivetrain.api.columns import TOKEN_COLUMNS

        keys = frozenset(token_keys) if token_keys is not None else TOKEN_COLUMNS & set(columns)
        return cls(columns, tuple(seq_lens), keys, layout, meta or BatchMeta())

    # ---- facts --------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.seq_lens)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"no column {name!r}; columns are {sorted(self.columns)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.columns

    @property
    def num_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def offsets(self) -> tuple[int, ...]:
        """``len + 1`` cumulative sequence offsets (``cu_seqlens``), starting at 0."""
        return (0, *accumulate(self.seq_lens))

    def _is_flat(self, name: str) -> bool:
        return self.layout is Layout.PACKED and name in self.token_keys

    # ---- columns and metadata -----------------------------------------------------------
    def with_columns(self, token_keys: Iterable[str] | None = None, **columns: Any) -> Batch:
        """Add or replace columns. A replaced column keeps its per-token flag; a new one is
        per-token if named in ``token_keys`` (default: if it is a standard token column)."""
        from drivetrain.api.columns import TOKEN_COLUMNS

        marked = set(token_keys) if token_keys is not None else set(TOKEN_COLUMNS)
        new = set(columns) - set(self.columns)
        keys = self.token_keys | (new & marked)
        return replace(self, columns={**self.columns, **columns}, token_keys=frozenset(keys))

    def drop(self, *names: str) -> Batch:
        missing = [n for n in names if n not in self.columns]
        if missing:
            raise KeyError(f"cannot drop {missing}: columns are {sorted(self.columns)}")
        kept = {k: v for k, v in self.columns.items() if k not in names}
        return replace(self, columns=kept, token_keys=self.token_keys - set(names))

    def with_meta(self, **changes: Any) -> Batch:
        return replace(self, meta=replace(self.meta, **changes))

    # ---- row operations -----------------------------------------------------------------
    def select(self, indices: Sequence[int]) -> Batch:
        """The samples at ``indices``, in that order (repeats allowed)."""
        indices = [int(i) for i in indices]
        n = len(self)
        bad = [i for i in indices if not 0 <= i < n]
        if bad:
            raise BatchError(f"indices {bad[:5]} out of range for a batch of {n}")
        token_index: list[int] = []
        if self.layout is Layout.PACKED:
            offsets = self.offsets
            token_index = [t for i in indices for t in range(offsets[i], offsets[i + 1])]
        columns = {}
        for name, value in self.columns.items():
            ops = column_ops_for(value)
            columns[name] = ops.take(value, token_index if self._is_flat(name) else indices)
        return replace(self, columns=columns, seq_lens=tuple(self.seq_lens[i] for i in indices))

    def slice(self, start: int, stop: int) -> Batch:
        """Samples ``start .. stop-1`` (contiguous, cheaper than :meth:`select`)."""
        start, stop, _ = slice(start, stop).indices(len(self))
        stop = max(start, stop)
        offsets = self.offsets
        columns = {}
        for name, value in self.columns.items():
            lo, hi = (offsets[start], offsets[stop]) if self._is_flat(name) else (start, stop)
            columns[name] = column_ops_for(value).slice(value, lo, hi)
        return replace(self, columns=columns, seq_lens=self.seq_lens[start:stop])

    def split(self, sizes: Sequence[int]) -> list[Batch]:
        """Contiguous pieces of the given sizes, which must add up to ``len(self)``."""
        if sum(sizes) != len(self) or any(s < 0 for s in sizes):
            raise BatchError(f"split sizes {list(sizes)} do not add up to {len(self)}")
        bounds = (0, *accumulate(sizes))
        return [self.slice(a, b) for a, b in pairwise(bounds)]

    def chunk(self, chunks: int) -> list[Batch]:
        """``chunks`` contiguous pieces whose sizes differ by at most one."""
        return self.split(chunk_sizes(len(self), chunks))

    def reorder(self, order: Sequence[int]) -> Batch:
        """Rows permuted so that new row ``k`` is old row ``order[k]``."""
        inverse_permutation(order)  # validates that it is a permutation
        return self.select(order)

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Join batches with the same columns, token keys and layout (padded batches: the same
        width; pad or pack them first). See :func:`_merge_meta` for metadata."""
        if not batches:
            raise BatchError("cannot concat an empty list of batches")
        first = batches[0]
        for other in batches[1:]:
            if set(other.columns) != set(first.columns):
                raise BatchError(
                    f"cannot concat batches with columns {sorted(first.columns)} and "
                    f"{sorted(other.columns)}"
                )
            if (other.token_keys, other.layout) != (first.token_keys, first.layout):
                raise BatchError(
                    f"cannot concat a {other.layout.value} batch with token columns "
                    f"{sorted(other.token_keys)} to a {first.layout.value} one with "
                    f"{sorted(first.token_keys)}"
                )
        columns = {}
        for name, value in first.columns.items():
            values = [b.columns[name] for b in batches]
            try:
                columns[name] = column_ops_for(value).concat(values)
            except Exception as exc:
                raise BatchError(f"cannot concat column {name!r}: {exc}") from exc
        seq_lens = tuple(n for b in batches for n in b.seq_lens)
        return replace(first, columns=columns, seq_lens=seq_lens, meta=_merge_meta(batches))

    # ---- token-balanced partitioning ----------------------------------------------------
    # Every method keeps the samples of one ``sample_group`` value together (a unit: its
    # weight is its samples' tokens); without that column each sample is its own unit.
    def units(self) -> list[list[int]]:
        """The indivisible groups of sample indices (``sample_group``), in batch order."""
        if SAMPLE_GROUP not in self.columns:
            return [[i] for i in range(len(self))]
        return sample_units([int(g) for g in self.columns[SAMPLE_GROUP]])

    def _unit_lengths(self, units: Sequence[Sequence[int]]) -> list[int]:
        return [sum(self.seq_lens[i] for i in unit) for unit in units]

    def _check_units(self, units: Sequence[Sequence[int]], parts: int) -> None:
        if len(units) < parts and len(units) < len(self):
            raise BatchError(
                f"cannot split {len(units)} sample groups ({len(self)} samples) into {parts} "
                "parts: a sample_group is never split"
            )

    def balanced_parts(self, parts: int, *, equal_size: bool = False) -> list[list[int]]:
        """Index groups with about equal tokens each (e.g. one per data-parallel rank);
        ``equal_size``: the same number of units in each."""
        units = self.units()
        self._check_units(units, parts)
        found = balanced_partition(self._unit_lengths(units), parts, equal_size=equal_size)
        return expand_units(found, units)

    def token_budget_parts(self, max_tokens: int, *, min_parts: int = 1) -> list[list[int]]:
        """Index groups of at most ``max_tokens`` tokens each (dynamic micro-batches)."""
        units = self.units()
        lengths = self._unit_lengths(units)
        if len(units) < len(self):  # name the group a budget cannot hold, by its value
            for unit, tokens in zip(units, lengths, strict=True):
                if tokens > max_tokens:
                    group = int(self.columns[SAMPLE_GROUP][unit[0]])
                    raise BatchError(
                        f"sample_group {group} ({len(unit)} samples, kept together) has "
                        f"{tokens} tokens, more than max_tokens={max_tokens} per micro-batch; "
                        "raise the token budget or shorten the data"
                    )
            self._check_units(units, min_parts)
        found = token_budget_partition(lengths, max_tokens, min_parts=min_parts)
        return expand_units(found, units)

    def fixed_size_parts(self, size: int) -> list[list[int]]:
        """Consecutive index groups of ``size`` samples (a micro-batch size); a group that
        would split a unit takes the whole unit."""
        units = self.units()
        if size < 1:
            raise BatchError(f"micro-batch size must be >= 1, got {size}")
        parts: list[list[int]] = []
        for unit in units:
            if not parts or len(parts[-1]) >= size:
                parts.append([])
            parts[-1].extend(unit)
        return [sorted(part) for part in parts]

    def dp_shards(self, dp_size: int) -> list[list[int]]:
        """Which samples each data-parallel rank gets (:func:`.partition.dp_shard_indices`,
        over units): token-balanced, the same number of units per rank when they divide."""
        units = self.units()
        self._check_units(units, dp_size)
        return expand_units(dp_shard_indices(self._unit_lengths(units), dp_size), units)

    # ---- layout -------------------------------------------------------------------------
    def to_packed(self) -> Batch:
        """Flatten token columns to ``[sum(seq_lens), ...]``, dropping padding."""
        if self.layout is Layout.PACKED:
            return self
        columns = dict(self.columns)
        for name in self.token_keys:
            ops = column_ops_for(columns[name])
            if ops.pack is None:
                raise BatchError(f"column {name!r}: its type cannot change layout")
            columns[name] = ops.pack(columns[name], self.seq_lens)
        return replace(self, columns=columns, layout=Layout.PACKED)

    def to_padded(self, pad_values: Mapping[str, Any] | None = None) -> Batch:
        """Right-pad token columns to the longest sample; ``input_ids`` pads with
        ``meta.pad_token_id``, other columns with ``pad_values.get(name, 0)``."""
        if self.layout is Layout.PADDED:
            return self
        pads = {"input_ids": self.meta.pad_token_id, **(pad_values or {})}
        columns = dict(self.columns)
        for name in self.token_keys:
            ops = column_ops_for(columns[name])
            if ops.unpack is None:
                raise BatchError(f"column {name!r}: its type cannot change layout")
            columns[name] = ops.unpack(columns[name], self.seq_lens, pads.get(name, 0))
        return replace(self, columns=columns, layout=Layout.PADDED)
