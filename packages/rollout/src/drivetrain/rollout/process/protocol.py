"""The conversation between :mod:`client` and :mod:`server`: JSON messages (:mod:`wire`, never
pickle) over an authenticated loopback ``multiprocessing.connection``, tensors as raw bytes
(torch versions may differ at the ends).

Requests are ``(method, args)``; replies ``("ok", result)`` or
``("error", type name, message, remote traceback)``. A weight update is the request
``("update_weights", (version,))`` followed by ``("tensor", name, {"shape", "dtype"})`` + one
raw bytes message per tensor and a closing ``("end",)`` or ``("abort",)``; one reply comes
after the close. A message that is not wire data gets a ``ProtocolError`` reply.

While the server works on a call it sends ``ALIVE`` every ``KEEPALIVE_S`` seconds before the
reply (the client skips them), so the client tells a long call from a stopped or hung server
by the silence alone (``rollout.stall_timeout_s``), whatever the call.
"""

from __future__ import annotations

import socket

from drivetrain.api.errors import ConfigError, PluginError
from drivetrain.rollout.errors import BackendNotInstalledError, ProtocolError, RolloutProcessError

ADDRESS_ENV = "DRIVETRAIN_ROLLOUT_ADDRESS"
AUTHKEY_ENV = "DRIVETRAIN_ROLLOUT_AUTHKEY"
ALIVE = ("alive",)
KEEPALIVE_S = 1.0


def send_at_once(fd: int) -> None:
    """Turn off Nagle's algorithm on the TCP socket ``fd``: a message written in two parts
    (header, then a large body) otherwise waits for the peer's delayed ACK, ~40 ms a time on
    Linux loopback, measured on weight updates and calls racing a poll."""
    sock = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a duplicate descriptor
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        sock.close()


#: Exceptions re-raised as themselves on the client; anything else is a RolloutProcessError.
REMOTE_ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        KeyError,
        TypeError,
        RuntimeError,
        FileNotFoundError,
        ConfigError,
        PluginError,
        BackendNotInstalledError,
        ProtocolError,
    )
}


def remote_error(name: str, message: str, remote_traceback: str) -> Exception:
    cls = REMOTE_ERRORS.get(name)
    if cls is None:
        return RolloutProcessError(
            f"{name}: {message}\n--- in the rollout process ---\n{remote_traceback}"
        )
    return cls(message.strip("'\"") if cls is KeyError else message)
