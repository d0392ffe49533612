"""Checks of the machine and the model that run before any engine is built, so a job that
cannot run fails in one line instead of a traceback after start-up (or a silent substitute)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drivetrain.api.errors import ConfigError


@dataclass(frozen=True)
class Context:
    """The most tokens (prompt and response together) a model takes, and what sets it."""

    tokens: int
    source: str  # named in errors: "the model's context (max_position_embeddings=256)"


def model_context(model_path: str, *, trust_remote_code: bool = False) -> Context | None:
    """The context of the Hugging Face model at ``model_path`` (its position embeddings);
    ``None`` when its config does not say."""
    from transformers import AutoConfig

    _local_path_exists(model_path, "model config")
    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the model config at {model_path!r}: {exc}") from None
    positions = getattr(config.get_text_config(), "max_position_embeddings", None)
    if not positions:
        return None
    return Context(int(positions), f"the model's context (max_position_embeddings={positions})")


def load_tokenizer(path: str, *, trust_remote_code: bool = False, what: str = "tokenizer") -> Any:
    """The tokenizer at ``path``; one line naming it when it cannot load."""
    from transformers import AutoTokenizer

    _local_path_exists(path, what)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load the {what} at {path!r}: {exc}") from None


def _local_path_exists(path: str, what: str) -> None:
    """A path written as one (absolute, ``./``, ``../``, ``~``) that does not exist: said as
    such, not as transformers' complaint that it is no valid hub id."""
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
        raise ConfigError(f"cannot load the {what} at {path!r}: no such file or directory")


def check_devices(devices: Mapping[str, str], *, ray_address: str) -> None:
    """:func:`check_device` for each ``{config key: device}``. When joining a Ray cluster
    (``workers.ray_address``) the ranks run on machines this process cannot see: the engines
    check there."""
    if ray_address:
        return
    for key, requested in devices.items():
        check_device(key, requested)


def check_device(key: str, requested: str) -> None:
    """Refuse a CUDA device this machine does not show. Engines place each rank on its local
    GPU and would silently run ``cuda:7`` on ``cuda:0``; other device kinds are the engine's
    to check (the trainer cannot know every accelerator a plugin supports)."""
    kind, _, index = requested.partition(":")
    if kind != "cuda":
        return
    if index and not index.isdigit():
        raise ConfigError(f"{key}={requested} is not a device; use cuda or cuda:N")
    import torch

    visible = torch.cuda.device_count()
    if visible <= (int(index) if index else 0):
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        mask = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ConfigError(
            f"{key}={requested} but {visible} CUDA device(s) are visible on this machine{mask}"
        )


def check_output_dir(key: str, path: str) -> None:
    """Refuse an output directory that is a file, lies under a file, or cannot be created or
    written, before anything is computed (checked without writing anything)."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{key}={path} is a file, not a directory")
    existing = out.absolute()
    try:
        while not existing.exists():  # the first part of the path that exists is written into
            existing = existing.parent
    except PermissionError as exc:  # a parent without search permission
        raise ConfigError(f"{key}={path}: {exc.filename} is not accessible") from None
    if not existing.is_dir():
        raise ConfigError(f"{key}={path} is under the file {existing}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: {existing} is not writable")
