"""Messages on the rollout server connection as JSON: reading one never runs code.

``Connection.send``/``recv`` pickle, and unpickling bytes can call any importable function, so
both ends use :func:`send`/:func:`receive` (``send_bytes``/``recv_bytes`` of UTF-8 JSON) and
tensors travel as raw bytes after a JSON header (see :mod:`protocol`). JSON has no tuples,
bytes, dataclasses or enums, so they are tagged objects::

    (1, 2)                     {"$tuple": [1, 2]}
    b"\\x00"                    {"$bytes": "AA=="}
    {1: "a"} / {"$x": 1}       {"$dict": [[1, "a"]]} / {"$dict": [["$x", 1]]}
    FinishReason.STOP          {"$enum": "drivetrain.api.rollout:FinishReason", "value": "stop"}
    Prompt(token_ids=(1,))     {"$dataclass": "drivetrain.api.rollout:Prompt", "fields": {...}}

A class is rebuilt only if it is on the allow-list: the api's plain-data classes, the base
configs, and the config class an installed rollout or ckpt-engine plugin declares (the same
classes the registry would load for it). Its constructor runs, so its checks apply. Nothing
is imported by a name read from the wire other than those declared configs.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import numbers
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from drivetrain.api.config import LoraConfig, RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import PluginError
from drivetrain.api.rollout import Completion, FinishReason, Prompt, SamplingParams
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.rollout.config import BackendConfig
from drivetrain.rollout.errors import ProtocolError


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_DATACLASSES: dict[str, type] = {
    _name(cls): cls
    for cls in (
        Prompt,
        SamplingParams,
        Completion,
        SyncStats,
        Topology,
        LoraConfig,
        RolloutConfig,
        WeightSyncConfig,
        BackendConfig,
    )
}
_ENUMS: dict[str, type[enum.Enum]] = {_name(FinishReason): FinishReason}
_SCALARS = (str, int, float, bool, type(None))


def _declared_config(name: str) -> type | None:
    """The config class that an installed rollout or ckpt-engine plugin declares as ``name``
    (``module:Class``), imported through the registry as it would be for that plugin."""
    from drivetrain.api.registry import ckpt_engines, rollouts

    for registry in (rollouts, ckpt_engines):
        for plugin in registry.names():
            try:
                if registry.spec(plugin).config != name:
                    continue
                cls = registry.load_config_class(plugin, object)
            except PluginError:
                continue
            if dataclasses.is_dataclass(cls) and _name(cls) == name:
                _DATACLASSES[name] = cls
                return cls
    return None


def _to_json(value: Any) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        return [_to_json(item) for item in value]
    if kind is tuple:
        return {"$tuple": [_to_json(item) for item in value]}
    if isinstance(value, Mapping):
        if all(type(key) is str and not key.startswith("$") for key in value):
            return {key: _to_json(item) for key, item in value.items()}
        return {"$dict": [[_to_json(key), _to_json(item)] for key, item in value.items()]}
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, enum.Enum):
        return {"$enum": _name(kind), "value": _to_json(value.value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
        }
        return {"$dataclass": _name(kind), "fields": fields}
    if isinstance(value, numbers.Integral):  # numpy integers and the like
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, str):
        return str(value)
    raise TypeError(f"the rollout wire carries plain data only, not {kind.__qualname__}")


def _tagged(obj: dict[str, Any]) -> Any:
    tags = [key for key in obj if key.startswith("$")]
    if not tags:
        return obj
    if tags == ["$tuple"] and len(obj) == 1:
        return tuple(obj["$tuple"])
    if tags == ["$bytes"] and len(obj) == 1:
        return base64.b64decode(obj["$bytes"], validate=True)
    if tags == ["$dict"] and len(obj) == 1:
        return dict(obj["$dict"])
    if tags == ["$enum"] and set(obj) == {"$enum", "value"}:
        cls = _ENUMS.get(obj["$enum"])
        if cls is None:
            raise ValueError(f"enum {obj['$enum']!r} is not allowed on the rollout wire")
        return cls(obj["value"])
    if tags == ["$dataclass"] and set(obj) == {"$dataclass", "fields"}:
        name = obj["$dataclass"]
        cls = _DATACLASSES.get(name) or _declared_config(name)
        if cls is None:
            raise ValueError(f"class {name!r} is not allowed on the rollout wire")
        return cls(**obj["fields"])
    raise ValueError(f"unknown tag in {sorted(obj)}")


def encode(message: Any) -> bytes:
    """``message`` as UTF-8 JSON; ``TypeError`` for a value that is not plain data."""
    return json.dumps(_to_json(message), separators=(",", ":")).encode()


def decode(data: bytes) -> Any:
    """The message ``data`` encodes, or :class:`ProtocolError` (never executing anything)."""
    try:
        return json.loads(bytes(data).decode("utf-8"), object_hook=_tagged)
    except Exception as exc:  # bad UTF-8/JSON, a refused class, a failing constructor, depth
        head = bytes(data[:16])
        raise ProtocolError(
            f"not a drivetrain wire message ({type(exc).__name__}: {exc}; starts {head!r})"
        ) from None


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    return decode(conn.recv_bytes())
