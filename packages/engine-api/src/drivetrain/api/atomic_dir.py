"""Publish a directory all at once: write under a staging name, then rename.

A crash leaves either the previous directory or the new one, never a half-written directory
under the final name. Staging names start with ``.`` and end in ``.partial`` so that
:func:`remove_stale_staging` can clear what a crashed run left behind.

Replacing an existing directory swaps the two in one ``renameat2(RENAME_EXCHANGE)`` call
(Linux 3.15+, through ctypes): moving the old one aside first and the new one in second would
leave, after a crash between the two, no directory under the final name and the previous one
under a staging name that the next clean-up deletes (the conformance kit's
``check_checkpoint_atomic`` found this). Where the call is missing or the file system refuses
it, publishing falls back to the two renames.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

STAGING_SUFFIX = ".partial"


def staging_path(target: Path) -> Path:
    return target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}{STAGING_SUFFIX}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    names = os.fsencode(a), os.fsencode(b)
    if renameat2(_AT_FDCWD, names[0], _AT_FDCWD, names[1], _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False  # an old kernel, or a file system without exchange
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is replaced only once the new
    one is complete (in one atomic swap where the system allows), and removed after."""
    fsync_dir(staging)
    if not target.exists():
        os.replace(staging, target)
        fsync_dir(target.parent)
        return
    if _exchange(staging, target):
        old = staging  # the swap left the previous directory under the staging name
    else:
        old = staging_path(target)
        os.replace(target, old)
        os.replace(staging, target)
    fsync_dir(target.parent)  # the new directory is durable before the old one goes
    shutil.rmtree(old)


def remove_stale_staging(parent: Path) -> list[Path]:
    """Delete staging directories a crashed run left in ``parent``; returns what was removed."""
    stale = [p for p in parent.glob(f".*{STAGING_SUFFIX}") if p.is_dir()] if parent.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
