"""What the rollout, environment and transport kits share: running every check of a kit with
failures collected, and a pytest base class with one test per check."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar


class NotOptedIn(Exception):
    """Raised by an opt-in check whose harness did not opt in: the check is skipped."""


@dataclass(frozen=True)
class KitCheckResult:
    name: str
    error: str | None  # None when the check passed (or was skipped)
    skipped: str | None = None  # why an opt-in check did not run


def run_checks(checks: Mapping[str, Callable[[Any], None]], harness: Any) -> list[KitCheckResult]:
    """Every check in order; a failure is recorded, not raised (a contract violation may
    surface as any error)."""
    results = []
    for name, check in checks.items():
        try:
            check(harness)
        except NotOptedIn as exc:
            results.append(KitCheckResult(name, None, str(exc)))
        except Exception as exc:
            results.append(KitCheckResult(name, f"{type(exc).__name__}: {exc}"))
        else:
            results.append(KitCheckResult(name, None))
    return results


def _test_of(check: Callable[[Any], None]) -> Callable[[Any], None]:
    def test(self: KitConformance) -> None:
        try:
            check(self.harness())
        except NotOptedIn as exc:
            import pytest  # only under pytest, where this test runs

            pytest.skip(str(exc))

    test.__doc__ = check.__doc__
    return test


class KitConformance:
    """Under pytest: a subclass that sets ``CHECKS`` gets a ``test_<name>`` per check, each
    calling it with :meth:`harness`, which the author's subclass implements."""

    CHECKS: ClassVar[Mapping[str, Callable[[Any], None]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, check in cls.CHECKS.items():
            if not hasattr(cls, f"test_{name}"):
                setattr(cls, f"test_{name}", _test_of(check))

    def harness(self) -> Any:
        raise NotImplementedError("return the harness of the plugin under test")
