"""Helpers over nested Python lists and per-sample rows, shared by the kit and the fakes."""

from __future__ import annotations

import itertools
from typing import Any

from drivetrain.api.batch import Batch, Layout


def shape_of(value: Any) -> tuple[int, ...]:
    """Shape of a nested list of numbers."""
    shape: list[int] = []
    while isinstance(value, list | tuple):
        shape.append(len(value))
        value = value[0] if value else None
    return tuple(shape)


def flatten(value: Any) -> list[float]:
    if isinstance(value, list | tuple):
        return [x for item in value for x in flatten(item)]
    return [float(value)]


def sample_rows(batch: Batch, values: Any) -> list[list[Any]]:
    """A token column's values (as nested lists) split per sample, without padding."""
    if batch.layout is Layout.PACKED:
        return [list(values[a:b]) for a, b in itertools.pairwise(batch.offsets)]
    return [list(row[:n]) for row, n in zip(values, batch.seq_lens, strict=True)]
