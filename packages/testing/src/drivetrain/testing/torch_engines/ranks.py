"""Start a worker script on N local ranks, for engines' multi-process tests.

Each rank is a plain ``python script OUT_DIR ARGS...`` process with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port), one torch
thread and its own session, so a hung run (and anything it spawned) is killed as a group at the
deadline, and a rank that dies stops the others at once. Workers report with
:func:`write_result` (JSON) or their own writer read back by ``read`` (e.g. ``torch.load`` with
``weights_only=True``: nothing is unpickled); :func:`launch_ranks` returns the reports in rank
order.

With ``preload``, the ranks are forked from a process that has imported those modules already
(:mod:`drivetrain.testing.torch_engines.zygote`): a megatron rank then starts in a fraction of
a second instead of spending 11 s of CPU importing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from drivetrain.testing.torch_engines import zygote_client


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


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
    them from a process that has them (``DRIVETRAIN_ZYGOTE=0`` starts fresh ones)."""
    port = str(free_port())
    path = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
    deadline = time.monotonic() + timeout
    fork = bool(preload) and zygote_client.enabled()
    procs: list[tuple[subprocess.Popen[bytes] | zygote_client.ForkedProcess, Any]] = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=path,
            PYTHONFAULTHANDLER="1",
        )
        log_path = out_dir / f"rank{rank}.log"
        if fork:
            log_path.write_text("")
            argv = [str(script), str(out_dir), *args]
            rank_proc = zygote_client.forked(
                argv, preload=preload, env=env, stdout=log_path, stderr=log_path, deadline=deadline
            )
            procs.append((rank_proc, None))
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
