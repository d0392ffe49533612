"""Variants of a Hugging Face model directory for harnesses: the same weights with a few
``config.json`` keys changed (e.g. ``attention_dropout`` for the kit's RNG check)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def hf_variant(model_dir: str | os.PathLike[str], **config: Any) -> str:
    """A sibling of ``model_dir`` whose ``config.json`` has ``config`` applied; made once, and
    safely by several ranks at a time (each copies under its own name and renames it in)."""
    source = Path(model_dir)
    tag = "-".join(f"{k}={v}" for k, v in sorted(config.items()))
    target = source.with_name(f"{source.name}-{tag}")
    if target.is_dir():
        return str(target)
    staging = source.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
    shutil.copytree(source, staging)
    path = staging / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}, indent=2))
    try:
        os.rename(staging, target)
    except OSError:  # another rank got there first: same content
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    return str(target)
