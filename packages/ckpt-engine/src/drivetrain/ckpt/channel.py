"""The control channel of the colocated transport: authenticated loopback connections from
every receiver to the sender, with deadlines on every wait (a dead or hung peer raises
:class:`WeightSyncError` instead of blocking). Messages are plain data as JSON
(:mod:`drivetrain.runtime.wire`): ``Connection.send``/``recv`` would pickle, and reading a pickle
can run code."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.runtime.wire import PLAIN, WireError


def listen(host: str) -> tuple[Listener, dict[str, Any]]:
    authkey = secrets.token_bytes(16)
    listener = Listener((host, 0), authkey=authkey)
    address = listener.address
    return listener, {"address": [address[0], address[1]], "authkey": authkey.hex()}


def _no_delay(conn: Connection) -> Connection:
    """Send each message at once: a message over 16 KiB goes out as two writes, and Nagle's
    algorithm holds the second until the first is acknowledged (a 40 ms delayed ACK)."""
    with socket.socket(fileno=socket.dup(conn.fileno())) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def accept(listener: Listener, count: int, timeout_s: float) -> list[Connection]:
    """Accept ``count`` receivers within ``timeout_s`` (``Listener.accept`` has no timeout, so
    it runs in a thread and the listener is closed to end it)."""
    accepted: list[Connection] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            while len(accepted) < count:
                accepted.append(_no_delay(listener.accept()))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="weight-sync-accept", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() or failure:
        listener.close()
        for conn in accepted:
            conn.close()
        why = failure[0] if failure else f"timed out after {timeout_s:.0f} s"
        raise WeightSyncError(f"only {len(accepted)} of {count} receivers connected: {why}")
    return accepted


def connect(endpoint: dict[str, Any], timeout_s: float) -> Connection:
    host, port = endpoint["address"]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _no_delay(Client((host, int(port)), authkey=bytes.fromhex(endpoint["authkey"])))
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"cannot reach the weight-sync sender at {host}:{port}: {exc}"
                ) from exc
            time.sleep(0.05)  # the listener exists from prepare(); only a restart races here


def read(conn: Connection, peer: str) -> Any:
    """The message waiting on ``conn``; :class:`WeightSyncError` if the peer is gone or sent
    something that is not wire data."""
    try:
        return PLAIN.decode(conn.recv_bytes())
    except (EOFError, OSError) as exc:
        raise WeightSyncError(f"{peer} disconnected ({type(exc).__name__})") from exc
    except WireError as exc:
        raise WeightSyncError(f"{peer} sent a malformed message: {exc}") from None


def receive(conn: Connection, timeout_s: float, peer: str) -> Any:
    """The next message from ``peer``, or :class:`WeightSyncError` if it is gone or silent."""
    try:
        if not conn.poll(timeout_s):
            raise WeightSyncError(f"{peer} sent nothing for {timeout_s:.0f} s")
    except (EOFError, OSError) as exc:
        raise WeightSyncError(f"{peer} disconnected ({type(exc).__name__})") from exc
    return read(conn, peer)


def send(conn: Connection, message: Any, peer: str) -> None:
    try:
        conn.send_bytes(PLAIN.encode(message))
    except (OSError, EOFError) as exc:
        raise WeightSyncError(f"{peer} disconnected ({type(exc).__name__})") from exc
