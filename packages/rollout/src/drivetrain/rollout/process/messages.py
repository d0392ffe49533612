"""Messages on the rollout server connection: :mod:`drivetrain.runtime.wire` JSON (reading one never
runs code), with tensors as raw bytes after a JSON header (see :mod:`protocol`).

A class is rebuilt only if it is on the allow-list: the api's plain-data classes, the base
configs, and the config class an installed rollout or ckpt-engine plugin declares (the same
classes the registry would load for it). Nothing is imported by a name read from the wire other
than those declared configs.
"""

from __future__ import annotations

import dataclasses
from multiprocessing.connection import Connection
from typing import Any

from drivetrain.api.config import LoraConfig, RolloutConfig, WeightSyncConfig
from drivetrain.api.errors import PluginError
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, FinishReason, Prompt, SamplingParams
from drivetrain.api.routing import RoutedExperts
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.rollout.config import BackendConfig
from drivetrain.rollout.errors import ProtocolError
from drivetrain.runtime.wire import Codec, WireError, class_name


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
            if dataclasses.is_dataclass(cls) and class_name(cls) == name:
                return cls
    return None


CODEC = Codec(
    (
        Prompt,
        SamplingParams,
        Completion,
        Request,
        Chunk,
        RoutedExperts,
        SyncStats,
        Topology,
        LoraConfig,
        RolloutConfig,
        WeightSyncConfig,
        BackendConfig,
        FinishReason,
    ),
    resolve=_declared_config,
)


def encode(message: Any) -> bytes:
    """``message`` as UTF-8 JSON; ``TypeError`` for a value that is not plain data."""
    try:
        return CODEC.encode(message)
    except WireError as exc:
        raise TypeError(str(exc)) from None


def decode(data: bytes) -> Any:
    """The message ``data`` encodes, or :class:`ProtocolError` (never executing anything)."""
    try:
        return CODEC.decode(data)
    except WireError as exc:
        raise ProtocolError(str(exc)) from None


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(encode(message))


def receive(conn: Connection) -> Any:
    return decode(conn.recv_bytes())
