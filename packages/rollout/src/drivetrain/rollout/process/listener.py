"""The trainer's end of the rollout server connection: a loopback listener that waits for the
one peer holding the key, logging and skipping every other connection.

``Listener.accept`` authenticates inside ``accept`` and raises on the first connection that
fails (any local process may connect to a loopback port), and blocks for as long as a peer that
connected stays silent. Here each connection gets its own handshake thread (the stdlib's
HMAC challenge, both directions, on raw bytes: nothing is unpickled), so a wrong key, garbage,
a connect-and-close or a silent connection costs nothing but a log line, and the real peer is
accepted as soon as it answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
_POLL_S = 0.2  # how often the accept loop checks the deadline and the peer process


class AuthenticatedListener:
    """Listens on ``HOST`` (a free port) for the peer that knows ``authkey``."""

    def __init__(self, authkey: bytes) -> None:
        self._authkey = authkey
        self._socket = socket.create_server((HOST, 0))
        self._socket.settimeout(_POLL_S)
        self.address: tuple[str, int] = self._socket.getsockname()[:2]

    def close(self) -> None:
        self._socket.close()

    def accept(self, deadline: float, check: Callable[[], None]) -> Connection | None:
        """The first connection that passes the handshake before ``deadline`` (monotonic), or
        ``None``; ``check`` runs between waits and may raise (e.g. the peer process exited).
        Other connections are logged and closed; the listener is closed on return."""
        winner: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        pending: list[tuple[threading.Thread, Connection, socket.socket]] = []
        gave_up = threading.Event()

        def handshake(conn: Connection, peer: str) -> None:
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
            except Exception as exc:  # AuthenticationError, EOF, bad length, garbage...
                why = (
                    "still unauthenticated when the listener closed"
                    if gave_up.is_set()
                    else repr(exc)
                )
                log.warning("rollout listener: skipped a connection from %s (%s)", peer, why)
                conn.close()
            else:
                winner.put(conn)

        accepted = None
        try:
            while winner.empty() and time.monotonic() < deadline:
                check()
                try:
                    sock, (host, port) = self._socket.accept()
                except TimeoutError:
                    continue
                sock.setblocking(True)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # see send_at_once
                # The handshake owns a duplicate descriptor; ``sock`` stays ours, to shut the
                # connection down if it is still silent at the end.
                conn = Connection(os.dup(sock.fileno()))
                thread = threading.Thread(
                    target=handshake, args=(conn, f"{host}:{port}"), daemon=True
                )
                pending.append((thread, conn, sock))
                thread.start()
            with contextlib.suppress(queue.Empty):
                accepted = winner.get_nowait()
            return accepted
        finally:
            self.close()  # one peer, one accept: later connections are refused by the kernel
            gave_up.set()
            _end(pending, accepted)
            while not winner.empty():
                winner.get_nowait().close()  # a second peer with the key: none is expected


def _end(
    pending: list[tuple[threading.Thread, Connection, socket.socket]], keep: Connection | None
) -> None:
    """Wake the handshakes still reading from a silent peer (a shutdown ends their reads) and
    join them, so that each skipped connection is logged before the caller goes on."""
    for _, conn, sock in pending:
        if conn is not keep:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
    for thread, _, sock in pending:
        thread.join(timeout=5)
        sock.close()
