"""Start a worker script on N local ranks (torchrun's environment, no torchrun agent).

Each rank is a plain ``python script ...`` process with ``RANK``/``WORLD_SIZE``/``MASTER_*``
set, one torch thread, and its own session so a hung run (and anything it spawned, such as
megatron-core's checkpoint writer) is killed as a group at the deadline. Workers write
``rank{r}.pt`` into the output directory; :func:`launch` returns those, rank order.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def launch(
    script: str, out_dir: Path, *args: str, nproc: int = 2, timeout: float = 300
) -> list[Any]:
    port = str(free_port())
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
            OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONFAULTHANDLER="1",
        )  # fmt: skip
        log = open(out_dir / f"rank{rank}.log", "w")  # noqa: SIM115 (closed below)
        command = [sys.executable, str(HERE / script), str(out_dir), *args]
        procs.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True), log))  # fmt: skip
    deadline = time.monotonic() + timeout
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
            time.sleep(0.2)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's own session
                proc.wait()
            log.close()
    if failed is None and any(p.returncode for p, _ in procs):
        failed = f"exit codes {[p.returncode for p, _ in procs]}"
    if failed:
        logs = "\n".join(f"--- rank {r}\n{_tail(out_dir / f'rank{r}.log')}" for r in range(nproc))
        raise AssertionError(f"{script} failed: {failed}\n{logs}")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


def write_result(out_dir: str, value: Any) -> None:
    torch.save(value, Path(out_dir, f"rank{os.environ.get('RANK', '0')}.pt"))


def single_thread() -> None:
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
