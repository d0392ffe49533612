"""Publish a directory all at once: write under a staging name, then rename.

A crash leaves either the previous directory or the new one, never a half-written directory
under the final name. Staging names start with ``.`` and end in ``.partial`` so that
:func:`remove_stale_staging` can clear what a crashed run left behind.

Replacing an existing directory swaps the two in one ``renameat2(RENAME_EXCHANGE)`` call
(Linux 3.15+, through ctypes): moving the old one aside first and the new one in second would
leave, after a crash between the two, no directory under the final name and the previous one
under a staging name that the next clean-up deletes (the conformance kit's
``check_checkpoint_atomic`` found this). Where the call is missing or the file system refuses
it (macOS, old kernels), publishing falls back to two renames with the previous directory
moved aside to ``.<name>.previous``, a name clean-up does not delete but puts back when the
final name is missing (a crash between the renames).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from pathlib import Path

STAGING_SUFFIX = ".partial"
PREVIOUS_SUFFIX = ".previous"


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
        old = target.parent / f".{target.name}{PREVIOUS_SUFFIX}"
        if old.exists():  # an earlier replacement's leftover: the target is the newer one
            shutil.rmtree(old)
        os.replace(target, old)
        os.replace(staging, target)
    fsync_dir(target.parent)  # the new directory is durable before the old one goes
    shutil.rmtree(old)


def remove_stale_staging(parent: Path) -> list[Path]:
    """Delete staging directories a crashed run left in ``parent``, and put back a previous
    directory a crash between the fallback's two renames left aside; returns what was removed."""
    if not parent.is_dir():
        return []
    for previous in [p for p in parent.glob(f".*{PREVIOUS_SUFFIX}") if p.is_dir()]:
        final = parent / previous.name[1 : -len(PREVIOUS_SUFFIX)]
        if final.exists():  # the new one landed; removing the old one was cut short
            shutil.rmtree(previous, ignore_errors=True)
        else:
            os.replace(previous, final)
    stale = [p for p in parent.glob(f".*{STAGING_SUFFIX}") if p.is_dir()]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
