"""A checkpoint that does not fit on its disk ends the run in one line, saying how much to free.

A full disk surfaces in many shapes: ``OSError`` ENOSPC from our own writes, torch's zip
writer's ``[enforce fail at inline_container.cc] unexpected pos 704 vs 598`` (a short write,
no errno), DCP's ``CheckpointException`` quoting either per rank, a Ray task error quoting
them. So a failed save is
judged by its error chain's errno and text, and, for torch's errno-less message, by the free
space left where it was writing.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from drivetrain.trainer.errors import CheckpointError

_MB = 1 << 20
#: below this much free space, torch's short-write message means a full disk
NEARLY_FULL = 64 * _MB
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(path: Path) -> int:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0


def _size(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def out_of_space(exc: BaseException, path: Path) -> bool:
    """Whether ``exc``, raised while writing under ``path``, means that filesystem is full."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return "unexpected pos" in str(exc) and _free_bytes(path) < NEARLY_FULL


@contextlib.contextmanager
def space_checked(staging: Path, previous: Path | None) -> Iterator[None]:
    """Around writing a checkpoint into ``staging``: a full disk becomes one
    :class:`CheckpointError` naming the path and the megabytes to free (the last checkpoint's
    size, ``previous``, or what was written before the disk filled), and the partial
    checkpoint is removed so that the space it took is free again."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit) or not out_of_space(exc, staging):
            raise
        needed = max(_size(previous) if previous else 0, _size(staging))
        shutil.rmtree(staging, ignore_errors=True)
        free = _free_bytes(staging)
        short = max(1, -(-(needed - free) // _MB))
        raise CheckpointError(
            f"no space left writing {staging} ({_amount(free)} free, a checkpoint takes about "
            f"{_amount(needed)}); free {short} MB and rerun with --resume auto"
        ) from None


def _amount(size: int) -> str:
    return f"{size / _MB:.0f} MB" if size >= 10 * _MB else f"{size / 1024:.0f} KB"
