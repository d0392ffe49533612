"""A backend's model directory, checked up front (its device: ``drivetrain.runtime.devices``)."""

from __future__ import annotations

from pathlib import Path


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
