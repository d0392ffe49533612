"""POSIX shared-memory segments that never outlive their run.

A segment's name carries its owner, ``dt-sync-<pid>-<token>-<index>`` (``<token>`` is random,
so one process may create several pairs). The owner unlinks its segments on close, at
interpreter exit (``atexit``: normal exit, unhandled exception, ``sys.exit``) and on SIGTERM when
no one else handles that signal. A SIGKILL runs none of that, so every new sender first reaps:
on a machine with ``/dev/shm`` it unlinks the segments of this user whose owner process is gone.

Segments are opened with ``shm_open`` directly rather than through
``multiprocessing.shared_memory``: its resource tracker is a helper process that dies with its
parent's process group (so it does not save a killed run) and, before Python 3.13, also unlinks
segments that another process merely attached to.
"""

from __future__ import annotations

import _posixshmem
import atexit
import contextlib
import logging
import mmap
import os
import re
import secrets
import signal
import threading
from pathlib import Path
from types import FrameType

logger = logging.getLogger(__name__)

PREFIX = "dt-sync-"
NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]{{8}}-\d+$")
SHM_DIR = Path("/dev/shm")

_owned: dict[str, int] = {}  # segment name -> pid that created it (a forked child is not it)
_lock = threading.RLock()  # re-entrant: the SIGTERM handler may interrupt a holder
_atexit_registered = False


class Segment:
    """One mapped segment; ``buf`` is its memory."""

    def __init__(self, name: str, size: int = 0, *, create: bool = False) -> None:
        if not NAME.match(name):
            raise ValueError(f"{name!r} is not a weight-sync segment name ({PREFIX}...)")
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(f"/{name}", flags, mode=0o600)
        try:
            if create:
                _register(name)  # ours now: from here on, every exit path unlinks it
                os.ftruncate(fd, size)
                if hasattr(os, "posix_fallocate"):
                    # reserve the pages now: tmpfs only promises them, and a full /dev/shm
                    # would otherwise kill the first pack with SIGBUS instead of raising here
                    os.posix_fallocate(fd, 0, size)
            else:
                size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            if create:  # shm_open succeeded with O_EXCL: the name is ours to unlink
                unlink(name)
            raise
        finally:
            os.close(fd)
        self.name = name
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap (the name stays until :func:`unlink`); a no-op while tensors still view it."""
        with contextlib.suppress(BufferError):
            self.buf.release()
            self._mmap.close()


def create_owned(size: int, count: int) -> list[Segment]:
    """``count`` new segments of ``size`` bytes owned by this process."""
    token = secrets.token_hex(4)
    segments: list[Segment] = []
    try:
        for index in range(count):
            segments.append(Segment(f"{PREFIX}{os.getpid()}-{token}-{index}", size, create=True))
    except BaseException:
        for segment in segments:
            segment.close()
            unlink(segment.name)
        raise
    return segments


def unlink(name: str) -> None:
    with _lock:
        _owned.pop(name, None)
    with contextlib.suppress(FileNotFoundError):
        _posixshmem.shm_unlink(f"/{name}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:  # a killed process nobody has waited for yet is a zombie: dead all the same
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def reap_orphans() -> list[str]:
    """Unlink this user's segments whose owner process is gone; returns their names.

    A pid reused by an unrelated live process keeps its segments until that one exits too
    (a leak, never a wrong unlink). Without ``/dev/shm`` (not Linux) there is nothing to list.
    """
    if not SHM_DIR.is_dir():
        return []
    reaped = []
    for entry in os.scandir(SHM_DIR):
        match = NAME.match(entry.name)
        if match is None or int(match[1]) == os.getpid():
            continue
        with contextlib.suppress(FileNotFoundError):
            if entry.stat().st_uid != os.getuid() or _alive(int(match[1])):
                continue
            unlink(entry.name)
            reaped.append(entry.name)
    if reaped:
        logger.warning("unlinked shared memory left by dead weight-sync senders: %s", reaped)
    return reaped


def _unlink_owned() -> None:
    pid = os.getpid()
    with _lock:
        mine = [name for name, owner in _owned.items() if owner == pid]
    for name in mine:
        unlink(name)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _unlink_owned()
    signal.signal(signum, signal.SIG_DFL)  # then die of SIGTERM as if we had never been here
    os.kill(os.getpid(), signum)


def _register(name: str) -> None:
    global _atexit_registered
    with _lock:
        _owned[name] = os.getpid()
        first = not _atexit_registered
        _atexit_registered = True
    if first:
        atexit.register(_unlink_owned)
    # SIGTERM's default kills the process without running atexit. A handler someone else
    # installed is their policy (if it exits through SystemExit, atexit runs), so it stays;
    # only the main thread may install one. Elsewhere the next sender reaps.
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)
