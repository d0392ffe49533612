"""Tool arguments no policy should write, made from a tool's JSON schema, for the environment
kit: each argument in turn gets values of every other JSON type, ``None``, a list, a huge
string, and values outside its ``enum``, ``minimum``/``maximum`` or ``maxLength``, while the
other required arguments hold plausible values. A policy early in training writes all of
these; an episode must answer each with an observation, never an exception. Standard library
only."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: one plausible value per JSON type (for the arguments not being fuzzed)
PLAUSIBLE: dict[str, Any] = {
    "string": "a",
    "integer": 1,
    "number": 1.5,
    "boolean": True,
    "array": [],
    "object": {},
    "null": None,
}
#: one value of each JSON type, to put where another type is expected
OF_EACH_TYPE: dict[str, Any] = {
    "string": "five",
    "integer": 5,
    "number": 2.5,
    "boolean": True,
    "array": ["a"],
    "object": {"x": 1},
    "null": None,
}
HUGE = "9" * 100_000


def _types(prop: Mapping[str, Any]) -> list[str]:
    wanted = prop.get("type")
    if isinstance(wanted, str):
        return [wanted]
    return [t for t in wanted or () if isinstance(t, str)]


def _plausible(prop: Mapping[str, Any]) -> Any:
    if prop.get("enum"):
        return next(iter(prop["enum"]))
    types = _types(prop)
    return PLAUSIBLE.get(types[0], "a") if types else "a"


def _bad_values(prop: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(why it is bad, value) for one property's schema."""
    types = _types(prop)
    bad: list[tuple[str, Any]] = []
    if types:
        for name, value in OF_EACH_TYPE.items():
            fits = name in types or (name == "integer" and "number" in types)
            if not fits:
                bad.append((f"{name} where the schema says {' or '.join(types)}", value))
    else:  # any type is allowed: the odd ones
        bad += [("null", None), ("array", ["a"]), ("object", {"x": 1})]
    bad.append(("a 100,000-character string", HUGE))
    if "enum" in prop:
        bad.append(("a value outside its enum", "not-one-of-them"))
    if isinstance(prop.get("minimum"), (int, float)):
        bad.append(("below its minimum", prop["minimum"] - 1))
    if isinstance(prop.get("maximum"), (int, float)):
        bad.append(("above its maximum", prop["maximum"] + 1))
    if "integer" in types or "number" in types:
        bad += [("a huge number", 10**18), ("a negative number", -1)]
    return bad


def bad_arguments(parameters: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(what is wrong, arguments) for a tool whose ``parameters`` is a JSON schema object:
    one argument bad at a time, the other required ones plausible."""
    properties: Mapping[str, Any] = parameters.get("properties") or {}
    required = [k for k in parameters.get("required") or () if k in properties]
    out = []
    for key, prop in properties.items():
        prop = prop if isinstance(prop, Mapping) else {}
        base = {k: _plausible(properties[k]) for k in required if k != key}
        for why, value in _bad_values(prop):
            out.append((f"{key}={value!r:.40} ({why})", {**base, key: value}))
    return out
