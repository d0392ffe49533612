"""Run a rollout engine in a server process, possibly of another Python environment.

The server (:mod:`server`) is started with the given interpreter in its own session (so its
children, e.g. vLLM's workers, go down with it), connects back over an authenticated loopback
connection (:mod:`listener`; messages are JSON, :mod:`wire`), and builds the engine there.
Every call waits on the reply *and* on the process: a server that dies raises
:class:`RolloutProcessError` with the tail of its log instead of hanging.
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
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from drivetrain.api.config import WeightSyncConfig
from drivetrain.api.engine import NamedTensor
from drivetrain.api.requests import Chunk, Request
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.api.weight_sync import SyncStats, Topology
from drivetrain.rollout.config import BackendConfig
from drivetrain.rollout.errors import ProtocolError, RolloutProcessError
from drivetrain.rollout.process import wire
from drivetrain.rollout.process.listener import AuthenticatedListener
from drivetrain.rollout.process.protocol import ADDRESS_ENV, AUTHKEY_ENV, remote_error
from drivetrain.rollout.weights import tensor_to_bytes

# Variables that would make the other interpreter load this environment's packages.
_ISOLATE = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


class RolloutProcess(Rollout):
    """A :class:`Rollout` whose engine lives in a server process."""

    def __init__(self, backend: str, config: BackendConfig, launch: BackendConfig) -> None:
        super().__init__(config)
        python = Path(launch.python).expanduser()
        if not python.is_file() or not os.access(python, os.X_OK):
            raise FileNotFoundError(
                f"rollout.python={launch.python!r} is not an executable interpreter; create the "
                f"environment with: python -m drivetrain.rollout.env {backend} <dir>"
            )
        self.backend = backend
        self.request_timeout_s = launch.request_timeout_s
        # one request and its reply at a time: a poller thread and a weight update share the
        # connection (re-entrant: a failing weight stream sends its abort from inside)
        self._conversation = threading.RLock()
        authkey = secrets.token_bytes(32)
        listener = AuthenticatedListener(authkey)
        fd, log_name = tempfile.mkstemp(prefix=f"drivetrain-{backend}-", suffix=".log")
        self.log_path = Path(log_name)
        env = {k: v for k, v in os.environ.items() if k not in _ISOLATE}
        env.update(item.split("=", 1) for item in launch.env)
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
        deadline = time.monotonic() + launch.start_timeout_s
        try:
            self.conn = self._accept(listener, deadline)
            self.info: dict[str, Any] = self._call(
                "start", backend, config, timeout=deadline - time.monotonic()
            )
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

    def _died(self, what: str) -> RolloutProcessError:
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

    def _reply(self, timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if self.process.poll() is not None:
                raise self._died("died")
            if deadline is not None and time.monotonic() > deadline:
                self._finalizer()
                raise self._died(f"did not answer within {timeout:.0f} s")
        try:
            reply = wire.receive(self.conn)
        except (EOFError, ConnectionResetError):
            raise self._died("closed the connection") from None
        except ProtocolError as exc:  # e.g. an older drivetrain-rollout there, which pickled
            raise ProtocolError(
                f"the {self.backend} rollout process's reply is {exc}; is drivetrain-rollout in "
                "its environment the same version as here?"
            ) from None
        match reply:
            case ("ok", result):
                return result
            case ("error", str(name), str(message), str(remote_traceback)):
                raise remote_error(name, message, remote_traceback)
        raise ProtocolError(
            f"the {self.backend} rollout process sent an unknown reply {reply!r:.200}"
        )

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        with self._conversation:
            if self.process.poll() is not None:
                raise self._died("is not running")
            try:
                wire.send(self.conn, (method, args))
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise self._died(f"dropped the connection ({exc})") from exc
            return self._reply(self.request_timeout_s if timeout is None else timeout)

    # ---- the rollout contract -----------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[Completion]:
        return self._call("generate", list(prompts), params)

    def submit(self, requests: Sequence[Request]) -> None:
        self._call("submit", list(requests))

    def poll(self, timeout_s: float = 0.0) -> list[Chunk]:
        return self._call("poll", timeout_s, timeout=self.request_timeout_s + timeout_s)

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        return self._call("abort", None if request_ids is None else list(request_ids))

    def pause_generation(self, *, abort: bool = False) -> int:
        return self._call("pause_generation", abort)

    def resume_generation(self) -> None:
        self._call("resume_generation")

    def update_weights(self, weights: Iterable[NamedTensor], *, version: int) -> None:
        """Streams tensors as bytes; the server applies them only once the stream ended
        cleanly, so a failing stream leaves the old weights in use."""
        with self._conversation:
            self._stream_weights(weights, version)

    def _stream_weights(self, weights: Iterable[NamedTensor], version: int) -> None:
        wire.send(self.conn, ("update_weights", (version,)))
        try:
            for name, tensor in weights:
                meta, data = tensor_to_bytes(tensor)
                wire.send(self.conn, ("tensor", name, meta))
                self.conn.send_bytes(data)
        except (BrokenPipeError, ConnectionResetError) as exc:  # the server is gone
            raise self._died(f"dropped the weight stream ({exc})") from exc
        except BaseException:
            if self.process.poll() is None:
                wire.send(self.conn, ("abort",))
                with contextlib.suppress(Exception):
                    self._reply(self.request_timeout_s)
            raise
        wire.send(self.conn, ("end",))
        self._reply(self.request_timeout_s)

    @property
    def weight_version(self) -> int:
        return self._call("weight_version")

    def sleep(self, level: int = 1) -> bool:
        super().sleep(level)
        return self._call("sleep", level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self._call("wake_up", None if tags is None else tuple(tags))

    # ---- weight sync: the receiving end lives in the server, next to the weights ------------
    def connect_weight_sync(
        self,
        transport: str,
        config: WeightSyncConfig,
        *,
        rank: int,
        topology: Topology,
        endpoint: Mapping[str, Any],
    ) -> None:
        self._call("connect_weight_sync", transport, config, rank, topology, dict(endpoint))

    def receive_weights(self, version: int) -> SyncStats:
        return self._call("receive_weights", version)

    def disconnect_weight_sync(self) -> None:
        if self.process.poll() is None:
            self._call("disconnect_weight_sync")

    def shutdown(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(Exception):
                self._call("shutdown", timeout=60)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        self._finalizer()
        with contextlib.suppress(Exception):
            self.conn.close()
        if self.process.returncode == 0:
            self.log_path.unlink(missing_ok=True)
