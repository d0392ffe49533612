"""Plain data between drivetrain processes as JSON: reading a message never runs code.

``multiprocessing.connection.Connection.send``/``recv`` pickle, and unpickling bytes can call
any importable function, so every drivetrain channel (the rollout server connection, the
colocated weight-sync channel) sends UTF-8 JSON with ``send_bytes``/``recv_bytes`` through a
:class:`Codec`. JSON has no tuples, bytes, dataclasses or enums, so they are tagged objects::

    (1, 2)                     {"$tuple": [1, 2]}
    b"\\x00"                    {"$bytes": "AA=="}
    {1: "a"} / {"$x": 1}       {"$dict": [[1, "a"]]} / {"$dict": [["$x", 1]]}
    FinishReason.STOP          {"$enum": "drivetrain.api.rollout:FinishReason", "value": "stop"}
    Prompt(token_ids=(1,))     {"$dataclass": "drivetrain.api.rollout:Prompt", "fields": {...}}

A dataclass or enum is rebuilt only if the codec allows it (its ``classes``, or what its
``resolve`` hook returns for a name); its constructor runs, so its checks apply. Nothing is
imported by a name read from the wire.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from drivetrain.api.errors import DrivetrainError

if TYPE_CHECKING:  # importing multiprocessing here would register __mp_main__ in every process
    from multiprocessing.connection import Connection

_SCALARS = frozenset((str, int, float, bool, type(None)))


class WireError(DrivetrainError, ValueError):
    """Bytes on a drivetrain channel that are not a message of its codec (refused, never
    unpickled), or a value that is not plain data."""


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def config_fields(config: Any) -> dict[str, Any]:
    """The constructor's fields of a config dataclass, by name: how a config crosses to another
    environment, where its plugin rebuilds it with its own class as installed there (which
    this side may not have)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}


class Codec:
    """Encodes plain data (scalars, lists, tuples, dicts, bytes) and the allowed dataclasses
    and enums; ``resolve(name)`` may allow more classes by name (it must not import by it)."""

    def __init__(
        self,
        classes: Iterable[type] = (),
        *,
        resolve: Callable[[str], type | None] | None = None,
        what: str = "drivetrain wire",
    ) -> None:
        self.classes = {class_name(cls): cls for cls in classes}
        self.resolve = resolve
        self.what = what
        #: per dataclass met while encoding: its constructor's fields, in order
        self._init_fields: dict[type, tuple[str, ...]] = {}
        #: allowed dataclasses met while decoding, by their wire name
        self._dataclasses: dict[str, type] = {}

    def _allowed(self, name: str) -> type | None:
        cls = self.classes.get(name)
        if cls is None and self.resolve is not None:
            cls = self.resolve(name)
            if cls is not None:
                self.classes[name] = cls
        return cls

    def _to_json(self, value: Any) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is list or kind is tuple:
            # token ids and log-probs: one C-level type check instead of a call per item
            if _SCALARS.issuperset(map(type, value)):
                items = list(value)
            else:
                items = [self._to_json(item) for item in value]
            return items if kind is list else {"$tuple": items}
        names = self._init_fields.get(kind)
        if names is not None:  # a dataclass seen before (requests, chunks: hundreds a call)
            fields = {name: self._to_json(getattr(value, name)) for name in names}
            return {"$dataclass": class_name(kind), "fields": fields}
        if isinstance(value, Mapping):
            if all(type(key) is str and not key.startswith("$") for key in value):
                return {key: self._to_json(item) for key, item in value.items()}
            return {"$dict": [[self._to_json(k), self._to_json(v)] for k, v in value.items()]}
        return self._rare_to_json(value, kind)

    def _rare_to_json(self, value: Any, kind: type) -> Any:
        """Bytes, enums, a dataclass met for the first time, numbers of other types."""
        if isinstance(value, bytes | bytearray | memoryview):
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, enum.Enum):
            return {"$enum": class_name(kind), "value": self._to_json(value.value)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            self._init_fields[kind] = tuple(f.name for f in dataclasses.fields(value) if f.init)
            return self._to_json(value)
        if isinstance(value, numbers.Integral):  # numpy integers and the like
            return int(value)
        if isinstance(value, numbers.Real):
            return float(value)
        if isinstance(value, str):
            return str(value)
        raise WireError(f"the {self.what} carries plain data only, not {kind.__qualname__}")

    def _tagged(self, obj: dict[str, Any]) -> Any:
        # the frequent shapes first: a tuple, a dataclass already checked once, a plain dict
        if len(obj) == 1 and "$tuple" in obj:
            return tuple(obj["$tuple"])
        if len(obj) == 2 and "fields" in obj:
            checked = self._dataclasses.get(obj.get("$dataclass"))
            if checked is not None:
                return checked(**obj["fields"])
        if not any(key.startswith("$") for key in obj):
            return obj
        tags = [key for key in obj if key.startswith("$")]
        if tags == ["$bytes"] and len(obj) == 1:
            return base64.b64decode(obj["$bytes"], validate=True)
        if tags == ["$dict"] and len(obj) == 1:
            return dict(obj["$dict"])
        if tags[0] in ("$enum", "$dataclass") and len(tags) == 1:
            name = obj[tags[0]]
            cls = self._allowed(name) if isinstance(name, str) else None
            if cls is None:
                raise ValueError(f"class {name!r} is not allowed on the {self.what}")
            if tags == ["$enum"] and set(obj) == {"$enum", "value"} and issubclass(cls, enum.Enum):
                return cls(obj["value"])
            if set(obj) == {"$dataclass", "fields"} and dataclasses.is_dataclass(cls):
                self._dataclasses[name] = cls
                return cls(**obj["fields"])
        raise ValueError(f"unknown tag in {sorted(obj)}")

    def encode(self, message: Any) -> bytes:
        """``message`` as UTF-8 JSON; :class:`WireError` for a value that is not plain data."""
        return json.dumps(self._to_json(message), separators=(",", ":")).encode()

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """The message ``data`` encodes, or :class:`WireError` (never executing anything)."""
        try:
            return json.loads(bytes(data).decode("utf-8"), object_hook=self._tagged)
        except Exception as exc:  # bad UTF-8/JSON, a refused class, a failing constructor, depth
            head = bytes(data[:16])
            raise WireError(
                f"not a {self.what} message ({type(exc).__name__}: {exc}; starts {head!r})"
            ) from None

    def send(self, conn: Connection, message: Any) -> None:
        conn.send_bytes(self.encode(message))

    def receive(self, conn: Connection) -> Any:
        return self.decode(conn.recv_bytes())


#: plain data only: no dataclass or enum is rebuilt
PLAIN = Codec()
