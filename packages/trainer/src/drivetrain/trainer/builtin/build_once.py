"""A built-in task's assets, built into the cache once and shared by every later run."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from drivetrain.runtime.atomic_dir import fsync_dir, staging_path


def build_once(target: Path, build: Callable[[Path], None]) -> None:
    """``build`` the directory ``target`` into a staging directory and rename it into place,
    unless it exists. Not ``publish()``: torchrun ranks may build at the same time; the first
    rename wins and the others drop their identical copy instead of replacing what a peer may
    be reading."""
    if target.is_dir():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(target)
    staging.mkdir()
    try:
        build(staging)
        fsync_dir(staging)
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
