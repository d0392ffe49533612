"""Which device a backend runs on, and its model directory, checked up front."""

from __future__ import annotations

from pathlib import Path

import torch


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("rollout.device='cuda' but torch sees no CUDA device")
    return device


def model_dir(path: str) -> Path:
    """The model directory, or a clear error (no hub downloads behind the user's back)."""
    if not path:
        raise FileNotFoundError("rollout.model_path is empty: set it to a Hugging Face model dir")
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"rollout.model_path={path!r} is not a Hugging Face model directory "
            "(no config.json there)"
        )
    return directory
