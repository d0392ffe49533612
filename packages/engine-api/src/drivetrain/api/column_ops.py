"""How a batch handles the values in its columns, whatever library they come from.

The api never imports torch or numpy. A column value is opaque; the batch asks this registry for
the four or six row operations it needs. Lists and tuples are built in. ``torch.Tensor`` and
``numpy.ndarray`` are registered *by name*: their operations resolve the library's module from
``sys.modules`` when a value of that type is first handled (such a value exists, so its library
is already imported). Any other type (jax arrays, a backend's own tensor) registers itself:

    register_column_ops(MyTensor, ColumnOps(length=..., take=..., slice=..., concat=...))
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.api.errors import BatchError


@dataclass(frozen=True)
class ColumnOps:
    """Row operations over a column value's first dimension.

    ``pack`` turns a padded ``[n, T, ...]`` value into a flat ``[sum(lens), ...]`` one; ``unpack``
    is its inverse (right padding with ``pad``). They are optional: a type without them can live
    in batches but not change layout.
    """

    length: Callable[[Any], int]
    take: Callable[[Any, Sequence[int]], Any]
    slice: Callable[[Any, int, int], Any]
    concat: Callable[[Sequence[Any]], Any]
    pack: Callable[[Any, Sequence[int]], Any] | None = None
    unpack: Callable[[Any, Sequence[int], Any], Any] | None = None


def _list_pack(value: Sequence[Sequence[Any]], lens: Sequence[int]) -> list[Any]:
    return [item for row, n in zip(value, lens, strict=True) for item in row[:n]]


def _list_unpack(value: Sequence[Any], lens: Sequence[int], pad: Any) -> list[list[Any]]:
    width, rows, start = max(lens, default=0), [], 0
    for n in lens:
        rows.append(list(value[start : start + n]) + [pad] * (width - n))
        start += n
    return rows


LIST_OPS = ColumnOps(
    length=len,
    take=lambda value, idx: [value[i] for i in idx],
    slice=lambda value, start, stop: list(value[start:stop]),
    concat=lambda values: [item for value in values for item in value],
    pack=_list_pack,
    unpack=_list_unpack,
)


def _array_ops(module_name: str, concat_name: str) -> ColumnOps:
    """Ops for array libraries with numpy-style indexing (``x[[1, 3]]``, ``x[i, :n]``)."""

    def module() -> Any:
        return sys.modules[module_name]

    def take(value: Any, idx: Sequence[int]) -> Any:
        return value[list(idx)] if idx else value[0:0]

    def concat(values: Sequence[Any]) -> Any:
        return getattr(module(), concat_name)(list(values))

    def pack(value: Any, lens: Sequence[int]) -> Any:
        if not lens:
            return value.reshape((0, *value.shape[2:]))
        return concat([value[i, :n] for i, n in enumerate(lens)])

    def unpack(value: Any, lens: Sequence[int], pad: Any) -> Any:
        width = max(lens, default=0)
        shape = (len(lens), width, *value.shape[1:])
        if module_name == "torch":
            out = module().full(shape, pad, dtype=value.dtype, device=value.device)
        else:
            out = module().full(shape, pad, dtype=value.dtype)
        start = 0
        for i, n in enumerate(lens):
            out[i, :n] = value[start : start + n]
            start += n
        return out

    return ColumnOps(
        length=lambda value: int(value.shape[0]),
        take=take,
        slice=lambda value, start, stop: value[start:stop],
        concat=concat,
        pack=pack,
        unpack=unpack,
    )


_BY_TYPE: dict[type, ColumnOps] = {list: LIST_OPS, tuple: LIST_OPS}
_BY_NAME: dict[str, ColumnOps] = {
    "torch.Tensor": _array_ops("torch", "cat"),
    "numpy.ndarray": _array_ops("numpy", "concatenate"),
}


def register_column_ops(kind: type | str, ops: ColumnOps) -> None:
    """Teach batches a column type, given as a class or as ``"module.QualName"`` (so that
    registering does not import the library). Subclasses inherit the registration."""
    if isinstance(kind, str):
        _BY_NAME[kind] = ops
    else:
        _BY_TYPE[kind] = ops


def column_ops_for(value: Any) -> ColumnOps:
    """The registered ops for ``value``'s type or its nearest registered base class."""
    for cls in type(value).__mro__:
        if cls in _BY_TYPE:
            return _BY_TYPE[cls]
        named = _BY_NAME.get(f"{cls.__module__}.{cls.__qualname__}")
        if named is not None:
            return named
    raise BatchError(
        f"no column ops registered for {type(value).__module__}.{type(value).__qualname__}; "
        "call drivetrain.api.register_column_ops(type, ColumnOps(...)) for it"
    )
