"""The version of the engine-api contract, and version ranges that plugins declare against it.

Plugins say which api versions they implement (``">=0.1,<0.2"``); the registry checks that
range before it imports the plugin's code. The api must stay stdlib-only, so this is a small
parser for the subset of PEP 440 specifiers that version ranges need (release numbers only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

API_VERSION = "0.1.0"

_OPERATORS = ("~=", "==", "!=", ">=", "<=", ">", "<")
_RELEASE = re.compile(r"^\d+(\.\d+)*$")


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.1.2"`` -> ``(0, 1, 2)``; local or pre-release suffixes are not part of api versions."""
    text = text.strip()
    if not _RELEASE.match(text):
        raise ValueError(f"not a release version: {text!r} (expected digits and dots, e.g. '0.1')")
    return tuple(int(part) for part in text.split("."))


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)), b + (0,) * (width - len(b))


@dataclass(frozen=True)
class _Clause:
    operator: str
    version: tuple[int, ...]

    def contains(self, version: tuple[int, ...]) -> bool:
        have, want = _padded(version, self.version)
        if self.operator == "~=":
            # ~=1.4 means >=1.4,<2 ; ~=1.4.2 means >=1.4.2,<1.5
            prefix = self.version[:-1]
            return have >= want and version[: len(prefix)] == prefix
        return {
            "==": have == want,
            "!=": have != want,
            ">=": have >= want,
            "<=": have <= want,
            ">": have > want,
            "<": have < want,
        }[self.operator]


@dataclass(frozen=True)
class VersionRange:
    """A comma-separated conjunction of clauses, e.g. ``">=0.1,<0.2"``."""

    text: str
    clauses: tuple[_Clause, ...]

    @classmethod
    def parse(cls, text: str) -> VersionRange:
        clauses = []
        for raw in text.split(","):
            raw = raw.strip()
            operator = next((op for op in _OPERATORS if raw.startswith(op)), None)
            if operator is None:
                raise ValueError(
                    f"invalid version range {text!r}: clause {raw!r} must start with one of "
                    f"{', '.join(_OPERATORS)}"
                )
            version = parse_version(raw[len(operator) :])
            if operator == "~=" and len(version) < 2:
                raise ValueError(f"invalid version range {text!r}: '~=' needs two components")
            clauses.append(_Clause(operator, version))
        return cls(text=text, clauses=tuple(clauses))

    def contains(self, version: str) -> bool:
        parsed = parse_version(version)
        return all(clause.contains(parsed) for clause in self.clauses)

    def __str__(self) -> str:
        return self.text
