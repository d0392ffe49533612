"""One run per output directory at a time.

A second run started on a live run's directory (a scheduler's requeue, a second terminal) used
to resume from the live run's newest checkpoint, and its start-up clean-up deleted the live
run's half-written ``.step_N.partial``: the first run died at its next save. The writing
process (rank 0, or the controller) now holds an exclusive ``flock`` on ``.<dir>.lock`` beside
the output directory for the whole run, taken before it reads or cleans anything there; the
OS releases it when the process ends, however it ends. A run that finds it held refuses in one
line naming the holder (pid, host, start time). The lock file sits beside the directory, not
in it, so ``--overwrite`` (which moves the directory aside) cannot move it away, and it is
left in place afterwards: deleting a lock file others may be waiting on would let two runs
lock two different files.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from drivetrain.trainer.errors import RunDirectoryError


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextlib.contextmanager
def owning(out: Path, *, writer: bool) -> Iterator[None]:
    """Hold ``out``'s lock for the body (only the writing process takes it)."""
    if not writer:
        yield
        return
    held = _acquire(Path(out))
    try:
        yield
    finally:
        held.close()


def _acquire(out: Path) -> IO[str]:
    path = lock_path(out.absolute())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        held = open(path, "a+")  # noqa: SIM115 (kept open: the lock lives as long as the file)
    except OSError as exc:
        raise RunDirectoryError(_cannot(out, exc)) from None
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        held.seek(0)
        holder = held.read().strip()
        held.close()
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise RunDirectoryError(_cannot(out, exc)) from None
        raise RunDirectoryError(
            f"{out} is in use by another run ({_describe(holder)}): wait for it to end or stop "
            "it, or pick another run.output_dir"
        ) from None
    held.seek(0)
    held.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    held.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}))
    held.flush()
    return held


def _describe(holder: str) -> str:
    try:
        info = json.loads(holder)
        return f"pid {info['pid']} on {info['host']}, started {info['started']}"
    except (ValueError, KeyError, TypeError):
        return "a process that is starting"


def _cannot(out: Path, exc: OSError) -> str:
    why = "its name is too long" if exc.errno == errno.ENAMETOOLONG else exc.strerror
    return f"cannot use {out} as the run's output directory: {why}"
