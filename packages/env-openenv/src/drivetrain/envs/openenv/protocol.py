"""OpenEnv's wire protocol, client side: one environment session over a WebSocket.

An OpenEnv server (``openenv.core.env_server.create_app``) gives each WebSocket connection to
``/ws`` an environment of its own. The client sends JSON messages ``{"type": "reset", "data":
{...reset keywords}}``, ``{"type": "step", "data": {...action fields}}`` and ``{"type":
"close"}``; the server answers ``{"type": "observation", "data": {"observation": {...},
"reward": r, "done": d}}`` or ``{"type": "error", "data": {"message", "code"}}``. The plain
HTTP ``/reset`` and ``/step`` make a new environment per request, so a multi-turn episode needs
the socket. ``GET /schema`` gives the action's and observation's JSON schemas.

Spoken here with ``websockets`` alone: the server framework (FastAPI, Gradio, MCP) that
OpenEnv's own client package brings is not needed to play an environment.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import ClientConnection, connect

from drivetrain.api.errors import DrivetrainError

#: The error code a server answers an action that does not fit the action's schema with: the
#: policy's fault, shown to it as an observation, never a failure of the job.
VALIDATION_ERROR = "VALIDATION_ERROR"
CAPACITY_REACHED = "CAPACITY_REACHED"


class OpenEnvError(DrivetrainError, RuntimeError):
    """The server, or the way to it, failed: the message is one line naming the URL (the
    command line prints it alone, as it does every ``DrivetrainError``)."""


class ActionRejected(Exception):
    """The server refused an action as invalid for its schema (``VALIDATION_ERROR``)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


def http_base(url: str) -> str:
    """The server's HTTP base URL (no trailing slash), or a one-line ``ValueError``."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"openenv: url must be http(s)://host:port of a server, got {url!r}")
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def ws_url(base: str) -> str:
    scheme, rest = base.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/ws"


def fetch_schema(base: str, headers: Mapping[str, str], timeout_s: float) -> dict[str, Any]:
    """``GET /schema``: ``{"action": <JSON schema>, "observation": <JSON schema>, ...}``."""
    request = urllib.request.Request(f"{base}/schema", headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            schema = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise OpenEnvError(
            f"openenv: {base}/schema answered HTTP {exc.code}: is this an OpenEnv server "
            "(and, if it wants one, is the token set)?"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)  # a URLError wraps the socket's error
        raise OpenEnvError(f"openenv: no OpenEnv server at {base}: {reason}") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise OpenEnvError(f"openenv: {base}/schema has no action schema: not an OpenEnv server")
    return schema


def _error_line(base: str, data: Mapping[str, Any]) -> str:
    code, message = data.get("code", "UNKNOWN"), str(data.get("message", "")).strip()
    if code == CAPACITY_REACHED:
        return (
            f"openenv: {base} refused a session: it holds at most {data.get('max_sessions')} "
            "and each episode in flight holds one: start the server with max_concurrent_envs "
            ">= run.prompts_per_step x sampling.n"
        )
    first = message.splitlines()[0] if message else "(no message)"
    return f"openenv: {base} failed ({code}): {first}"


class Session:
    """One environment on the server, for one episode. Not shared between threads."""

    def __init__(self, base: str, headers: Mapping[str, str], timeout_s: float) -> None:
        self.base, self.timeout_s = base, timeout_s
        self._socket: ClientConnection | None = None
        # the connection outlives any one call: a stack holds it open (websockets >= 17.1
        # deprecates a connection used outside its context manager)
        self._stack = contextlib.ExitStack()
        try:
            self._socket = self._stack.enter_context(
                connect(
                    ws_url(base),
                    additional_headers=dict(headers),
                    open_timeout=timeout_s,
                    close_timeout=min(timeout_s, 5.0),
                    proxy=None,
                )
            )
        except (OSError, WebSocketException, TimeoutError) as exc:
            raise OpenEnvError(f"openenv: cannot open a session at {base}/ws: {exc}") from None

    def reset(self, options: Mapping[str, Any]) -> dict[str, Any]:
        """The first observation: ``{"observation": {...}, "reward": r, "done": d}``."""
        return self._call({"type": "reset", "data": dict(options)})

    def step(self, action: Mapping[str, Any]) -> dict[str, Any]:
        """What the action led to; :class:`ActionRejected` if the server's schema refused it."""
        return self._call({"type": "step", "data": dict(action)})

    def _call(self, message: Mapping[str, Any]) -> dict[str, Any]:
        if self._socket is None:
            raise OpenEnvError(f"openenv: the session at {self.base} is closed")
        with contextlib.suppress(ConnectionClosed):  # a refused session sends its error, then
            self._socket.send(json.dumps(message))  # closes: the error is read below
        try:
            raw = self._socket.recv(timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise OpenEnvError(
                f"openenv: {self.base} sent no answer to {message['type']} within "
                f"{self.timeout_s:g} s (episode.options.timeout_s)"
            ) from None
        except ConnectionClosed as exc:
            self.close()
            raise OpenEnvError(f"openenv: {self.base} closed the session: {exc}") from None
        try:
            reply = json.loads(raw)
            data = reply.get("data") or {}
        except (ValueError, AttributeError):
            self.close()
            raise OpenEnvError(f"openenv: {self.base} answered {raw[:80]!r}: not OpenEnv") from None
        if reply.get("type") == "observation":
            return data
        if reply.get("type") == "error" and data.get("code") == VALIDATION_ERROR:
            raise ActionRejected(_validation_detail(data))
        self.close()
        raise OpenEnvError(_error_line(self.base, data))

    def close(self) -> None:
        """Ends the session (the server frees its environment); safe to call twice."""
        socket, self._socket = self._socket, None
        if socket is None:
            return
        try:
            socket.send(json.dumps({"type": "close"}))
            # the server frees the environment, then closes the socket: wait for that, so it
            # never writes to a socket this side already closed
            socket.recv(timeout=min(self.timeout_s, 5.0))
        except (ConnectionClosed, OSError, TimeoutError):
            pass
        self._stack.close()


def _validation_detail(data: Mapping[str, Any]) -> str:
    """pydantic's errors as one short line: ``guess: Input should be a valid integer``."""
    errors = data.get("errors")
    if not isinstance(errors, list) or not errors:
        return str(data.get("message", "invalid action"))
    lines = []
    for error in errors[:3]:
        loc = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        lines.append(f"{loc}: {error.get('msg', 'invalid')}" if loc else error.get("msg", ""))
    return "; ".join(lines)
