"""Directories that appear whole or not at all: write into a staging folder beside the target,
then rename it into place (checkpoints and HF exports share this)."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def staging_name(target: Path) -> str:
    return f"{target.name}.incomplete-{uuid.uuid4().hex[:8]}"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an existing ``target`` is replaced only after the new
    one is in place, so a crash leaves the old or the new directory, never neither."""
    fsync_dir(staging)
    if target.exists():
        old = target.parent / f"{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(target, old)
        os.replace(staging, target)
        shutil.rmtree(old)
    else:
        os.replace(staging, target)
    fsync_dir(target.parent)
