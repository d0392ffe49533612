"""The verifiers side, seen from the trainer: the sidecar process (``sidecar.py``) that runs in
the verifiers environment, hosts the hub's env server and is its client.

It runs in its own process group, started by ``PYTHON -P sidecar.py``; the pipes to it are the
only channel (JSON lines, never pickles), so nothing here listens. The hub's server listens on a
ZMQ ``ipc://`` socket in a folder only this user may enter (0700): the hub's server takes no
credentials, so the folder is what keeps others off it. Stopped on :meth:`Hub.close`, at exit,
and when this process dies (the sidecar ends with its stdin, the server with the sidecar).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from drivetrain.api.errors import DrivetrainError

SIDECAR = Path(__file__).with_name("sidecar.py")
#: the verifiers releases whose env-server protocol this adapter speaks (read in 0.4.0)
SERIES = "0.4."
INSTALL = "uv pip install --python {python} 'verifiers==0.4.*'"
#: variables of the trainer's environment that must not reach the verifiers interpreter
PRIVATE_VARS = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTEST_ADDOPTS")


class VerifiersError(DrivetrainError, RuntimeError):
    """The verifiers side failed: one line, naming the interpreter or the server's log (the
    command line prints it alone and exits 2)."""


def check_interpreter(python: str) -> str:
    """The interpreter's path, or a one-line ``ValueError`` (an option error)."""
    path = shutil.which(python) if os.sep not in python else python
    if not path or not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValueError(
            f"verifiers: episode.options.python: no Python interpreter at {python!r} (make one "
            "with verifiers: python -m drivetrain.envs.verifiers.venv DIR, then DIR/bin/python)"
        )
    return path


class Hub:
    """The sidecar: :meth:`call` and :meth:`submit` send it one request each."""

    def __init__(
        self,
        python: str,
        job: Mapping[str, Any],
        *,
        env: Mapping[str, str],
        pythonpath: str = "",
        start_timeout_s: float = 300.0,
    ) -> None:
        self.python = check_interpreter(python)
        self.job_id = str(job.get("id", ""))
        self.folder = tempfile.mkdtemp(prefix="drivetrain-verifiers-")  # 0700
        fd, self.log_path = tempfile.mkstemp(prefix="drivetrain-verifiers-", suffix=".log")
        self.address = f"ipc://{self.folder}/env.sock"
        self._lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._dead: str | None = None
        self._ready = False
        variables = {k: v for k, v in os.environ.items() if k not in PRIVATE_VARS}
        variables.update(env)
        if pythonpath:
            variables["PYTHONPATH"] = pythonpath
        with os.fdopen(fd, "wb") as log:
            self.process = subprocess.Popen(
                [self.python, "-P", str(SIDECAR)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=variables,
                start_new_session=True,  # its own process group: stopped as one
                cwd=self.folder,
            )
        self._reader = threading.Thread(target=self._read, name="verifiers-sidecar", daemon=True)
        self._reader.start()
        try:
            self._send({**job, "address": self.address, "series": SERIES})
            self.info = self._wait_ready(start_timeout_s)
        except BaseException:
            self.close()
            raise

    # --- start ------------------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        hello: dict[str, Any] = {}
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise VerifiersError(
                    f"verifiers: the environment server was not ready within {timeout_s:g} s "
                    f"(episode.options.start_timeout_s); its log: {self.log_path}"
                ) from None
            kind = event.get("event")
            if kind == "hello":
                hello = event
            elif kind == "ready":
                self._ready = True
                return {**hello, **event}
            else:
                raise VerifiersError(self._start_error(event))

    def _start_error(self, event: Mapping[str, Any]) -> str:
        kind, message = event.get("kind"), str(event.get("message", ""))
        install = INSTALL.format(python=self.python)
        if kind == "not_installed":
            return f"verifiers: verifiers is not installed in {self.python}: {install}"
        if kind == "version":
            return (
                f"verifiers: {self.python} has verifiers {message}; this adapter speaks the "
                f"env-server protocol of verifiers {SERIES}x: {install}"
            )
        if kind == "protocol":
            return (
                f"verifiers: the verifiers in {self.python} lacks the env-server API this "
                f"adapter uses ({message}): {install}"
            )
        if kind == "unknown_env":
            return (
                f"verifiers: no environment {self.job_id!r} in {self.python}: {message} "
                "(install it there, or put its folder in episode.options.pythonpath)"
            )
        if kind == "died":
            return (
                f"verifiers: the environment server exited ({message}) before it was ready; "
                f"its log: {self.log_path}{self._log_tail()}"
            )
        return (
            f"verifiers: the environment {self.job_id!r} failed to start: {message}; its log: "
            f"{self.log_path}"
        )

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            lines = [ln for ln in Path(self.log_path).read_text().splitlines() if ln.strip()]
            if lines:
                return f": {lines[-1].strip()[:200]}"
        return ""

    # --- requests ---------------------------------------------------------------------------

    def submit(self, request: Mapping[str, Any]) -> tuple[int, Future[dict[str, Any]]]:
        """Sends ``request``; its reply completes the future (a ``VerifiersError`` if the
        sidecar is gone)."""
        future: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._dead is not None:
                raise VerifiersError(self._dead)
            self._next += 1
            rid = self._next
            self._pending[rid] = future
        self._send({**request, "id": rid})
        return rid, future

    def call(self, request: Mapping[str, Any], timeout_s: float) -> dict[str, Any]:
        """One request, waited for; a reply with ``error`` raises it as one line."""
        _, future = self.submit(request)
        try:
            reply = future.result(timeout=timeout_s)
        except TimeoutError:
            raise VerifiersError(
                f"verifiers: the environment server gave no answer to {request.get('op')} "
                f"within {timeout_s:g} s; its log: {self.log_path}"
            ) from None
        if "error" in reply:
            raise VerifiersError(f"verifiers: {request.get('op')} failed: {reply['error']}")
        return reply

    def cancel(self, rid: int) -> None:
        """Asks the sidecar to drop request ``rid`` (the hub's ``cancel`` for a run)."""
        with contextlib.suppress(VerifiersError, OSError):
            self._send({"op": "cancel", "target": rid, "id": 0})

    def _send(self, message: Mapping[str, Any]) -> None:
        line = (json.dumps(message) + "\n").encode()
        try:
            with self._lock:
                assert self.process.stdin is not None
                self.process.stdin.write(line)
                self.process.stdin.flush()
        except (OSError, ValueError):
            raise VerifiersError(
                f"verifiers: the environment server is gone; its log: {self.log_path}"
            ) from None

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            try:
                message = json.loads(raw)
            except ValueError:
                continue  # not ours: the channel is a private fd, so this is never expected
            if "event" in message:
                self._events.put(message)
                continue
            with self._lock:
                future = self._pending.pop(message.get("id"), None)
            if future is not None and not future.done():
                future.set_result(message)
        code = self.process.wait()
        self._events.put({"event": "error", "kind": "died", "message": f"code {code}"})
        with self._lock:
            self._dead = (
                f"verifiers: the environment server exited (code {code}); "
                f"its log: {self.log_path}{self._log_tail()}"
            )
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(VerifiersError(self._dead))

    # --- stop -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the sidecar and the server (their whole process group); safe to call twice."""
        process = self.process
        with contextlib.suppress(OSError, ValueError):
            if process.stdin is not None:
                process.stdin.close()  # the sidecar's signal to stop its server and exit
        if self._ready:  # a sidecar that never came up is not waited for
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=15)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, sig)  # what is left of the group: the server, workers
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)
