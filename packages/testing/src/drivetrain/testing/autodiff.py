"""A minimal reverse-mode autodiff over Python floats, so the fake engine computes real
gradients of whatever loss it is handed, with no tensor library.

``Scalar`` is a node; ``Array`` is a flat list of nodes with the nested row structure of the
column it mirrors, supporting elementwise ``*``, ``+``, ``-``, ``/``, ``.exp()`` and ``.sum()``:
enough for token-mean and sequence losses written with operators, so the same loss code runs on
torch tensors and here. Losses needing other tensor functions (clamp, max) are torch-only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

Number = int | float


class Scalar:
    __slots__ = ("_backward", "_parents", "grad", "value")

    def __init__(
        self,
        value: float,
        parents: tuple[Scalar, ...] = (),
        backward: Callable[[float], tuple[float, ...]] | None = None,
    ) -> None:
        self.value = float(value)
        self.grad = 0.0
        self._parents = parents
        self._backward = backward

    def __repr__(self) -> str:
        return f"Scalar({self.value:.6g})"

    def __float__(self) -> float:
        return self.value

    # arithmetic --------------------------------------------------------------------------
    def __add__(self, other: Scalar | Number) -> Scalar:
        other = lift(other)
        return Scalar(self.value + other.value, (self, other), lambda g: (g, g))

    __radd__ = __add__

    def __mul__(self, other: Scalar | Number) -> Scalar:
        other = lift(other)
        a, b = self.value, other.value
        return Scalar(a * b, (self, other), lambda g: (g * b, g * a))

    __rmul__ = __mul__

    def __neg__(self) -> Scalar:
        return self * -1.0

    def __sub__(self, other: Scalar | Number) -> Scalar:
        return self + (-lift(other))

    def __rsub__(self, other: Number) -> Scalar:
        return lift(other) - self

    def __truediv__(self, other: Scalar | Number) -> Scalar:
        other = lift(other)
        a, b = self.value, other.value
        return Scalar(a / b, (self, other), lambda g: (g / b, -g * a / (b * b)))

    def exp(self) -> Scalar:
        out = math.exp(self.value)
        return Scalar(out, (self,), lambda g: (g * out,))

    def log(self) -> Scalar:
        a = self.value
        return Scalar(math.log(a), (self,), lambda g: (g / a,))

    def backward(self) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's ``grad``."""
        order: list[Scalar] = []
        visited: set[int] = set()
        stack: list[tuple[Scalar, bool]] = [(self, False)]
        while stack:  # iterative topological sort (graphs are deep: one node per token op)
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in visited:
                continue
            visited.add(id(node))
            stack.append((node, True))
            stack.extend((p, False) for p in node._parents)
        grads = {id(self): 1.0}
        for node in reversed(order):
            g = grads.pop(id(node), 0.0)
            if node._backward is None:
                node.grad += g
                continue
            for parent, pg in zip(node._parents, node._backward(g), strict=True):
                grads[id(parent)] = grads.get(id(parent), 0.0) + pg


def lift(x: Scalar | Number) -> Scalar:
    return x if isinstance(x, Scalar) else Scalar(float(x))


def logsumexp(xs: Sequence[Scalar]) -> Scalar:
    peak = max(x.value for x in xs)
    return sum(((x - peak).exp() for x in xs), Scalar(0.0)).log() + peak


def _flatten(value: Any) -> tuple[list[Any], tuple[int, ...] | None]:
    if isinstance(value, Array):
        return value.items, value.rows
    if value and isinstance(value[0], list | tuple):
        return [x for row in value for x in row], tuple(len(row) for row in value)
    return list(value), None


class Array:
    """A flat list of scalars plus the row lengths of the nested list it stands for."""

    def __init__(self, items: Iterable[Any], rows: tuple[int, ...] | None = None) -> None:
        self.items = list(items)
        self.rows = rows

    @classmethod
    def from_nested(cls, nested: Any) -> Array:
        """From a flat list or a list of rows."""
        items, rows = _flatten(nested)
        return cls(items, rows)

    def _zip(self, other: Any, op: Callable[[Any, Any], Any]) -> Array:
        if isinstance(other, Scalar | int | float):
            return Array([op(a, other) for a in self.items], self.rows)
        items, rows = _flatten(other)
        if rows != self.rows or len(items) != len(self.items):
            raise ValueError(f"shape mismatch: rows {self.rows} vs {rows}")
        return Array([op(a, b) for a, b in zip(self.items, items, strict=True)], self.rows)

    def __mul__(self, other: Any) -> Array:
        return self._zip(other, lambda a, b: a * b)

    __rmul__ = __mul__

    def __add__(self, other: Any) -> Array:
        return self._zip(other, lambda a, b: a + b)

    __radd__ = __add__

    def __sub__(self, other: Any) -> Array:
        return self._zip(other, lambda a, b: a - b)

    def __rsub__(self, other: Any) -> Array:
        return self._zip(other, lambda a, b: b - a)

    def __neg__(self) -> Array:
        return Array([-a for a in self.items], self.rows)

    def __truediv__(self, other: Any) -> Array:
        return self._zip(other, lambda a, b: a / b)

    def exp(self) -> Array:
        return Array([lift(a).exp() for a in self.items], self.rows)

    def sum(self) -> Scalar:
        return sum((lift(a) for a in self.items), Scalar(0.0))

    def tolist(self) -> list[Any]:
        """Plain floats in the original nesting."""
        values = [float(a) for a in self.items]
        if self.rows is None:
            return values
        out, start = [], 0
        for n in self.rows:
            out.append(values[start : start + n])
            start += n
        return out
