"""Tools an environment offers the policy: a function with its JSON-schema parameters.
Running a turn's calls without trusting them is :mod:`drivetrain.runtime.tool_calls`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Tool:
    """A function the policy may call: its ``parameters`` are a JSON-schema object
    (``{"type": "object", "properties": {...}, "required": [...]}``) and ``function`` is
    called with the arguments as keyword arguments, for at most ``timeout_s`` seconds."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    function: Callable[..., Any]
    timeout_s: float = 10.0

    def schema(self) -> dict[str, Any]:
        """The OpenAI function format chat templates take (``Environment.tools``)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": _plain(self.parameters),
            },
        }


def _plain(value: Any) -> Any:
    """A JSON-ready copy (dicts and lists) of a schema given as any mappings and sequences."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
