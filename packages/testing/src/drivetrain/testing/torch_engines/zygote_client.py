"""The test process's end of :mod:`drivetrain.testing.torch_engines.zygote`: processes forked from a
Python that has imported the heavy modules already, behaving like ``subprocess``'s.

``forked(argv, env=..., ...)`` returns a :class:`ForkedProcess` (``pid``, ``poll``, ``wait``,
``returncode``; its session is its pid, as with ``start_new_session=True``); :func:`run` is
``subprocess.run(..., capture_output=True, text=True)`` for such a process. One zygote serves
each test process, preload set and import-time environment (the variables third-party modules
read when imported: a test that sets ``HF_HUB_OFFLINE`` gets a zygote of its own).
``DRIVETRAIN_ZYGOTE=0`` makes both start fresh processes instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

#: set to 0 to start every process as a fresh ``python`` (no zygote)
ZYGOTE_VAR = "DRIVETRAIN_ZYGOTE"
#: environment variables modules may read at import time: part of a zygote's identity
IMPORT_TIME_ENV = (
    "CUDA",
    "HF_",
    "HUGGINGFACE",
    "KMP_",
    "MKL_",
    "OMP_",
    "PYTHON",
    "PYTORCH",
    "TORCH",
    "TRANSFORMERS",
    "TOKENIZERS",
)


def enabled() -> bool:
    return os.environ.get(ZYGOTE_VAR, "1") != "0"


class ForkedProcess:
    """A process forked by a zygote: ``poll``, ``wait``, ``returncode`` and ``pid`` as a
    ``Popen``'s (its exit code arrives through the zygote, its parent)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self.zygote.wait_for_change(0.5)
        return code

    def kill_session(self) -> None:
        """SIGKILL its session (what it started too) and wait for it."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.wait()


class _Zygote:
    """One zygote process; a reader thread records what it says (started pids in order, exit
    codes)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        command = [sys.executable, "-m", "drivetrain.testing.torch_engines.zygote", *preload]
        self.proc = subprocess.Popen(
            command, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "started" in message:
                    self.started.append(message["started"])
                if "exited" in message:
                    self.exits[message["exited"]] = message["code"]
                self.changed.notify_all()
        with self.changed:  # the zygote is gone: wake whoever waits for it
            self.changed.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_for_change(self, seconds: float) -> None:
        with self.changed:
            self.changed.wait(seconds)

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
        if not self.alive():  # nobody is left to report it: end its session, call it killed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            return -signal.SIGKILL
        return None

    def spawn(self, request: dict[str, object], deadline: float) -> ForkedProcess:
        """Fork one process; waits (until ``deadline``) for the zygote to import and answer."""
        assert self.proc.stdin is not None
        with self.changed:
            count = len(self.started)
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            while len(self.started) == count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    raise AssertionError(f"the zygote did not start {request['argv']} in time")
                self.changed.wait(min(left, 1.0))
            return ForkedProcess(self, self.started[count])


_zygotes: dict[tuple[object, ...], _Zygote] = {}
_lock = threading.Lock()


def _zygote(preload: Sequence[str], env: Mapping[str, str]) -> _Zygote:
    imported = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV))
    key = (tuple(preload), tuple(imported))
    with _lock:
        zygote = _zygotes.get(key)
        if zygote is None or not zygote.alive():
            zygote = _zygotes[key] = _Zygote(preload, env)
        return zygote


def forked(
    argv: Sequence[str],
    *,
    preload: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    stdout: str | Path,
    stderr: str | Path,
    deadline: float,
) -> ForkedProcess:
    """``python ARGV`` (a script, or ``-m`` and a module) forked from the zygote of
    ``preload``, its output appended to the files ``stdout`` and ``stderr``."""
    env = dict(os.environ if env is None else env)
    request = {
        "argv": list(argv),
        "env": env,
        "cwd": str(cwd or os.getcwd()),
        "stdout": str(stdout),
        "stderr": str(stderr),
    }
    return _zygote(preload, env).spawn(request, deadline)


def run(
    argv: Sequence[str],
    *,
    preload: Sequence[str],
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, ...)``, the
    process forked from a zygote when :func:`enabled`; ``TimeoutExpired`` past ``timeout``
    (its session killed)."""
    command = [sys.executable, *argv]
    if not enabled():
        return subprocess.run(
            command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
        )
    start = time.monotonic()
    deadline = start + (timeout if timeout is not None else 3600.0)
    with tempfile.TemporaryDirectory(prefix="drivetrain-forked-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        proc = forked(
            argv, preload=preload, env=env, cwd=cwd, stdout=out, stderr=err, deadline=deadline
        )
        try:
            code = proc.wait(None if timeout is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill_session()
            raise subprocess.TimeoutExpired(
                command,
                timeout or 0,
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            ) from None
        return subprocess.CompletedProcess(
            command, code, out.read_text(errors="replace"), err.read_text(errors="replace")
        )
