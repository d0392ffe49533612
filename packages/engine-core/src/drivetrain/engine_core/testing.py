"""Start a worker script on N local ranks, for engines' multi-process tests.

Each rank is a plain ``python script OUT_DIR ARGS...`` process with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port), one torch
thread and its own session, so a hung run (and anything it spawned) is killed as a group at the
deadline, and a rank that dies stops the others at once. Workers report with
:func:`write_result` (JSON) or their own writer read back by ``read`` (e.g. ``torch.load`` with
``weights_only=True``: nothing is unpickled); :func:`launch_ranks` returns the reports in rank
order.

With ``preload``, the ranks are forked from a process that has imported those modules already
(:mod:`drivetrain.engine_core.rank_zygote`, one per test process and preload set): a megatron
rank then starts in a fraction of a second instead of spending 11 s of CPU importing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

#: set to 0 to start every rank as a fresh ``python`` (no zygote)
ZYGOTE_VAR = "DRIVETRAIN_RANK_ZYGOTE"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


class _ForkedRank:
    """A rank forked by a :class:`_Zygote`: ``poll``, ``returncode`` and ``pid`` as a
    ``Popen``'s (its exit code arrives through the zygote, its parent)."""

    def __init__(self, zygote: _Zygote, pid: int) -> None:
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        return self.zygote.exit_code(self.pid)

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.05)
        return code


class _Zygote:
    """The launcher's end of a ``rank_zygote`` process: one reader thread records what it
    says (started pids in order, exit codes)."""

    def __init__(self, preload: Sequence[str]) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        command = [sys.executable, "-m", "drivetrain.engine_core.rank_zygote", *preload]
        self.proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.changed = threading.Condition()
        self.started: list[int] = []
        self.exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True, name="rank-zygote").start()

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

    def exit_code(self, pid: int) -> int | None:
        with self.changed:
            if pid in self.exits:
                return self.exits[pid]
        if not self.alive():  # nobody is left to report it: end its session, call it killed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            return -signal.SIGKILL
        return None

    def spawn(
        self, argv: list[str], env: dict[str, str], log: Path, deadline: float
    ) -> _ForkedRank:
        """Fork one rank; waits (until ``deadline``) for the zygote to import and answer."""
        assert self.proc.stdin is not None
        with self.changed:
            count = len(self.started)
            request = {"argv": argv, "env": env, "log": str(log)}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            while len(self.started) == count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    raise AssertionError(f"the rank zygote did not start {argv[0]} in time")
                self.changed.wait(min(left, 1.0))
            return _ForkedRank(self, self.started[count])

    def close(self) -> None:
        if self.alive():
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_zygotes: dict[tuple[str, ...], _Zygote] = {}


def _zygote(preload: Sequence[str]) -> _Zygote:
    key = tuple(preload)
    zygote = _zygotes.get(key)
    if zygote is None or not zygote.alive():
        zygote = _zygotes[key] = _Zygote(key)
    return zygote


def launch_ranks(
    script: Path,
    out_dir: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 300,
    pythonpath: Sequence[Path] = (),
    read: Callable[[Path, int], Any] | None = None,
    preload: Sequence[str] = (),
) -> list[Any]:
    """Run ``script`` on ``nproc`` ranks; raise ``AssertionError`` with every rank's log tail
    when one fails or the deadline passes. ``read(out_dir, rank)`` loads a rank's report
    (default: what :func:`write_result` wrote). ``preload``: modules the ranks import, to fork
    them from a process that has them (``DRIVETRAIN_RANK_ZYGOTE=0`` starts fresh ones)."""
    port = str(free_port())
    path = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
    deadline = time.monotonic() + timeout
    zygote = _zygote(preload) if preload and os.environ.get(ZYGOTE_VAR, "1") != "0" else None
    procs: list[tuple[subprocess.Popen[bytes] | _ForkedRank, Any]] = []
    for rank in range(nproc):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONFAULTHANDLER="1",
        )  # fmt: skip
        log_path = out_dir / f"rank{rank}.log"
        if zygote is not None:
            argv = [str(script), str(out_dir), *args]
            procs.append((zygote.spawn(argv, env, log_path, deadline), None))
            continue
        log = open(log_path, "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, str(script), str(out_dir), *args]
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs.append((proc, log))
    failed = None
    try:
        while any(p.poll() is None for p, _ in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {timeout:.0f} s"
                break
            bad = [p.returncode for p, _ in procs if p.poll() not in (None, 0)]
            if bad:
                failed = f"a rank exited with {bad[0]}"
                break
            time.sleep(0.1)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session
                proc.wait()
            if log is not None:
                log.close()
    if failed is None and any(p.returncode for p, _ in procs):
        failed = f"exit codes {[p.returncode for p, _ in procs]}"
    if failed:
        logs = "\n".join(f"--- rank {r}\n{_tail(out_dir / f'rank{r}.log')}" for r in range(nproc))
        raise AssertionError(f"{Path(script).name} failed: {failed}\n{logs}")
    return [(read or read_result)(out_dir, r) for r in range(nproc)]


def read_result(out_dir: Path, rank: int) -> Any:
    return json.loads((out_dir / f"rank{rank}.json").read_text())


def write_result(out_dir: str, value: Any) -> None:
    """This rank's report (JSON-serialisable) for :func:`launch_ranks`."""
    rank = os.environ.get("RANK", "0")
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(value))
