"""Run a rollout backend in a server process, possibly of another Python environment.

:func:`start_server_rollout` returns the one remote-rollout proxy
(:class:`~drivetrain.runtime.remote_rollout.RemoteRollout`) over a :class:`ServerProcess` channel.
The server (:mod:`server`) is started with the given interpreter in its own session (so its
children, e.g. vLLM's workers, go down with it), connects back over an authenticated loopback
connection (:mod:`listener`; messages are JSON, :mod:`messages`), and builds the backend there.
Every call waits on the reply *and* on the process: a server that dies raises
:class:`RolloutProcessError` with the tail of its log instead of hanging. A server that is
alive but silent (stopped, hung) for ``rollout.stall_timeout_s`` is killed and named in one
line (:class:`~drivetrain.api.errors.RolloutStalled`): while it works on a call it says so every
second (``protocol.ALIVE``); a quick call (``QUICK_CALLS``) must answer within the deadline
whatever it says; and a watchdog bounds each message on the wire (a weight stream blocks once
a stopped server's socket buffer is full, a reply stopped half-way blocks its reader).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from drivetrain.api.config import RolloutConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.errors import DrivetrainError, RolloutStalled
from drivetrain.api.hosting import HostingConfig
from drivetrain.rollout.errors import ProtocolError, RolloutProcessError
from drivetrain.rollout.process import messages
from drivetrain.rollout.process.listener import AuthenticatedListener
from drivetrain.rollout.process.protocol import ADDRESS_ENV, ALIVE, AUTHKEY_ENV, remote_error
from drivetrain.rollout.weights import tensor_to_bytes
from drivetrain.runtime.fair_lock import FairRLock
from drivetrain.runtime.hosted_rollout import child_env
from drivetrain.runtime.remote_rollout import QUICK_CALLS, RemoteRollout
from drivetrain.runtime.wire import config_fields

# A server that takes longer to shut down is killed (close): shutting down is not worth the
# request timeout (an hour by default) when the backend hangs there.
SHUTDOWN_TIMEOUT_S = 60.0


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _watch_sends(ref: weakref.ref[ServerProcess]) -> None:
    """Kill a server that takes nothing this side sends for its stall deadline (a stopped
    process: the send blocks once the socket's buffer is full), so the send fails and the
    caller names the stall. Ends with the channel."""
    while (channel := ref()) is not None and channel.process.poll() is None:
        sending, limit = channel._sending, channel.stall_timeout_s
        if sending is not None and time.monotonic() - sending[1] > limit:
            channel.stalled(sending[0], time.monotonic() - sending[1])
            return
        del channel
        time.sleep(min(0.5, limit / 4))


def start_server_rollout(
    backend: str, config: RolloutConfig, launch: HostingConfig | None = None
) -> RemoteRollout:
    """``backend`` built from ``config`` in a server process started as ``launch`` says
    (its ``python``, timeouts and ``env``; default: ``config``'s own). Any rollout the
    registry of that environment can load: this is the rollout host ``process``
    (:func:`drivetrain.runtime.hosted_rollout.rollout_host`). Only ``config``'s fields cross
    over; the server rebuilds the rollout's own config class from them, so ``config`` may be
    of a class this environment does not have (one built from the rollout's description)."""
    if launch is None:
        if not isinstance(config, HostingConfig):
            raise TypeError(f"{type(config).__name__} has no launch settings; pass launch=")
        launch, config = config, replace(config, python="")
    return RemoteRollout(config, ServerProcess(backend, config, launch))


class ServerProcess:
    """The channel to a rollout backend in a server process (``call`` by name, see
    :class:`~drivetrain.runtime.remote_rollout.Channel`)."""

    def __init__(self, backend: str, config: RolloutConfig, launch: HostingConfig) -> None:
        python = Path(launch.python).expanduser()
        if not python.is_file() or not os.access(python, os.X_OK):
            recipe = backend if backend in ("hf", "vllm", "sglang") else "--package <it> hf"
            raise FileNotFoundError(
                f"rollout.python={launch.python!r} is not an executable interpreter; create the "
                f"environment with: python -m drivetrain.rollout.env {recipe} <dir>"
            )
        self.backend = backend
        self.request_timeout_s = launch.request_timeout_s
        self.stall_timeout_s = launch.stall_timeout_s
        self._stall: str = ""  # why the server was killed as stalled ("": it was not)
        self._sending: tuple[str, float] | None = None  # what is on the wire, since when
        self._speaks_alive = False  # it said ALIVE once: its silence is a stall (older: never)
        # one request and its reply at a time: a poller thread and a weight update share the
        # connection (re-entrant: a failing weight stream sends its abort from inside)
        self._conversation = FairRLock()
        authkey = secrets.token_bytes(32)
        listener = AuthenticatedListener(authkey)
        fd, log_name = tempfile.mkstemp(prefix=f"drivetrain-{backend}-", suffix=".log")
        self.log_path = Path(log_name)
        env = child_env(launch.env)
        host, port = listener.address
        env[ADDRESS_ENV] = f"{host}:{port}"
        env[AUTHKEY_ENV] = authkey.hex()
        with os.fdopen(fd, "wb") as log:
            try:
                self.process = subprocess.Popen(
                    [str(python), "-m", "drivetrain.rollout.process.server"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except BaseException:
                listener.close()
                raise
        self._finalizer = weakref.finalize(self, _kill, self.process)
        threading.Thread(
            target=_watch_sends, args=(weakref.ref(self),), name="rollout-watchdog", daemon=True
        ).start()
        deadline = time.monotonic() + launch.start_timeout_s
        try:
            self.conn = self._accept(listener, deadline)
            self.info: dict[str, Any] = self._call(
                "start", (backend, config_fields(config)), timeout=deadline - time.monotonic()
            )
            self._speaks_alive = self._speaks_alive or "keepalive_s" in self.info
        except Exception as exc:
            if not isinstance(exc, RolloutProcessError):  # those carry the log already
                exc.add_note(f"rollout process log {self.log_path}:\n{self._log_tail()}")
            self._finalizer()
            raise
        except BaseException:
            self._finalizer()
            raise

    # ---- plumbing ------------------------------------------------------------------------
    def _log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return "\n".join(text)

    def _died(self, what: str) -> DrivetrainError:
        if self._stall:  # we killed it: say why, not the exit code of our own kill
            return RolloutStalled(self._stall)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)  # a broken connection comes just before the exit
        code = self.process.poll()
        return RolloutProcessError(
            f"the {self.backend} rollout process {what} (exit code {code}); log "
            f"{self.log_path}:\n{self._log_tail()}"
        )

    def _accept(self, listener: AuthenticatedListener, deadline: float) -> Connection:
        def check() -> None:
            if self.process.poll() is not None:
                raise self._died("exited before connecting")

        conn = listener.accept(deadline, check)
        if conn is None:
            raise self._died("did not connect in time")
        return conn

    def stalled(self, what: str, silent_s: float) -> RolloutStalled:
        """Kill the server, silent for ``silent_s`` seconds while ``what``, and say so."""
        self._stall = (
            f"the {self.backend} rollout process (pid {self.process.pid}) was silent for "
            f"{silent_s:.0f} s while {what} (rollout.stall_timeout_s={self.stall_timeout_s:g}): "
            f"it is alive but stopped or hung; it was killed (log {self.log_path})"
        )
        self._finalizer()
        return RolloutStalled(self._stall)

    def _reply(
        self, timeout: float | None, what: str = "answering a call", *, quick_s: float = 0.0
    ) -> Any:
        """The reply, skipping ``ALIVE``. The server must not be silent for its stall deadline
        (once it has shown it says ``ALIVE``: an older server never does); ``quick_s``: a quick
        call, which must answer within that whatever ``ALIVE`` says (a host hung inside it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        heard = asked = time.monotonic()
        while True:
            while not self.conn.poll(0.5):
                if self.process.poll() is not None:
                    raise self._died("died")
                now = time.monotonic()
                if quick_s and now - asked > quick_s:
                    raise self.stalled(what, now - asked)
                if self._speaks_alive and now - heard > self.stall_timeout_s:
                    raise self.stalled(what, now - heard)
                if deadline is not None and now > deadline:
                    self._finalizer()
                    raise self._died(f"did not answer within {timeout:.0f} s")
            try:
                with self._watched(f"sending its reply to {what.removeprefix('answering ')}"):
                    reply = messages.receive(self.conn)  # a reply stopped half-way blocks here
            except (EOFError, ConnectionResetError, BrokenPipeError):
                raise self._died("closed the connection") from None
            except ProtocolError as exc:  # e.g. an older drivetrain-rollout there, which pickled
                raise ProtocolError(
                    f"the {self.backend} rollout process's reply is {exc}; is drivetrain-rollout "
                    "in its environment the same version as here?"
                ) from None
            if reply != ALIVE:
                return self._result(reply)
            heard, self._speaks_alive = time.monotonic(), True

    def _result(self, reply: Any) -> Any:
        match reply:
            case ("ok", result):
                return result
            case ("error", str(name), str(message), str(remote_traceback)):
                raise remote_error(name, message, remote_traceback)
        raise ProtocolError(
            f"the {self.backend} rollout process sent an unknown reply {reply!r:.200}"
        )

    def _call(
        self,
        method: str,
        args: tuple[Any, ...],
        *,
        timeout: float | None = None,
        quick_s: float = 0.0,
    ) -> Any:
        with self._conversation:
            if self.process.poll() is not None:
                raise self._died("is not running")
            try:
                with self._watched(f"taking the call {method}"):
                    messages.send(self.conn, (method, args))
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise self._died(f"dropped the connection ({exc})") from exc
            timeout = self.request_timeout_s if timeout is None else timeout
            return self._reply(timeout, f"answering {method}", quick_s=quick_s)

    @contextlib.contextmanager
    def _watched(self, what: str) -> Iterator[None]:
        """One send or receive on the wire, bounded by the watchdog (:func:`_watch_sends`):
        only the wire's own time counts, not the caller's work between messages."""
        self._sending = (what, time.monotonic())
        try:
            yield
        finally:
            self._sending = None

    # ---- the channel ---------------------------------------------------------------------
    def call(self, method: str, *args: Any, wait_s: float = 0.0) -> Any:
        limit = SHUTDOWN_TIMEOUT_S if method == "shutdown" else self.request_timeout_s
        quick_s = self.stall_timeout_s + wait_s if method in QUICK_CALLS else 0.0
        return self._call(method, args, timeout=limit + wait_s, quick_s=quick_s)

    def send_weights_inline(self, weights: Iterable[NamedTensor], version: int) -> None:
        """Streams tensors as bytes; the server hands them to the rollout only once the
        stream ended cleanly, so a failing stream leaves the old weights in use (a bad name
        or shape may still leave a rollout that applies as it goes torn, see
        ``QueuedRollout.updating_weights``)."""
        with self._conversation:
            self._stream_weights(weights, version)

    def _stream_weights(self, weights: Iterable[NamedTensor], version: int) -> None:
        taking = f"taking the weights of version {version}"
        try:
            with self._watched(taking):
                messages.send(self.conn, ("update_weights", (version,)))
            for name, tensor in weights:
                meta, data = tensor_to_bytes(tensor)  # the sender's work: not the wire's time
                with self._watched(taking):
                    messages.send(self.conn, ("tensor", name, meta))
                    self.conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError) as exc:  # the server is gone
            raise self._died(f"dropped the weight stream ({exc})") from exc
        except BaseException:
            if self.process.poll() is None:
                with contextlib.suppress(Exception):  # the stream's own error is the one to see
                    with self._watched(taking):
                        messages.send(self.conn, ("abort",))
                    self._reply(self.request_timeout_s)
            raise
        try:
            with self._watched(taking):
                messages.send(self.conn, ("end",))
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise self._died(f"dropped the weight stream ({exc})") from exc
        self._reply(self.request_timeout_s, f"applying the weights of version {version}")

    def close(self) -> None:
        """After the server was asked to shut down: wait for it, else kill it; its log goes
        when it exited cleanly."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)
        self._finalizer()
        with contextlib.suppress(Exception):
            self.conn.close()
        if self.process.returncode == 0:
            self.log_path.unlink(missing_ok=True)
