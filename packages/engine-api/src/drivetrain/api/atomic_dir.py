"""Publish a directory all at once: write under a staging name, then rename.

A crash leaves either the previous directory or the new one, never a half-written directory
under the final name. Staging names start with ``.`` and end in ``.partial`` so that
:func:`remove_stale_staging` can clear what a crashed run left behind.
"""

from __future__ import annotations

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


def publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is replaced only once the new
    one is complete, and removed after the rename."""
    fsync_dir(staging)
    if target.exists():
        old = staging_path(target)
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)
    fsync_dir(target.parent)


def remove_stale_staging(parent: Path) -> list[Path]:
    """Delete staging directories a crashed run left in ``parent``; returns what was removed."""
    stale = [p for p in parent.glob(f".*{STAGING_SUFFIX}") if p.is_dir()] if parent.is_dir() else []
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
