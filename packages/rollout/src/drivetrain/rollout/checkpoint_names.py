"""The Hugging Face weight names and shapes of a model directory, read from safetensors
headers only (no tensor is loaded): what an engine holding that model accepts as new weights."""

from __future__ import annotations

from pathlib import Path

from safetensors import safe_open


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {directory}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes
