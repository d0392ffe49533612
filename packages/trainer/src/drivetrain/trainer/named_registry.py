"""Name → function tables for the parts of an RL algorithm users swap: advantage estimators
and policy losses. A user adds their own with the decorator, in a module named by
``algorithm.plugins`` (imported on every process before the first step), without editing the
trainer."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from drivetrain.api.errors import ConfigError

F = TypeVar("F", bound=Callable[..., object])


class NamedRegistry(Generic[F]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._items and self._items[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        try:
            return self._items[name]
        except KeyError:
            raise ConfigError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)


def import_plugins(modules: Iterable[str]) -> None:
    """Import the user's modules that register estimators, losses or rewards."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"cannot import algorithm plugin module {module!r}: {exc}") from None
