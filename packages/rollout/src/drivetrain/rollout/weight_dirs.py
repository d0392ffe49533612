"""Weights handed to an engine through a directory, for engines that load some updates only from
a path: LoRA adapters (vLLM, SGLang) as peft directories (safetensors + adapter_config.json), and
full updates for vLLM's worker processes. Each is assembled under a temporary name and renamed
into place."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from drivetrain.api.config import LoraConfig
from drivetrain.api.engine import NamedTensor

LORA_MARKERS = (".lora_A.", ".lora_B.")


def peek_adapter(weights: Iterable[NamedTensor]) -> tuple[bool, bool, Iterator[NamedTensor]]:
    """Whether a weight stream carries a LoRA adapter (its first name says), whether it is
    empty, and the stream with that first tensor still in it."""
    stream = iter(weights)
    first = next(stream, None)
    if first is None:
        return False, True, stream
    return is_adapter_weight(first[0]), False, itertools.chain([first], stream)


def is_adapter_weight(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


def adapter_update(
    items: Sequence[tuple[str, torch.Tensor]], lora_enabled: bool
) -> Sequence[tuple[str, torch.Tensor]] | None:
    """The stream itself if it is a LoRA adapter update (peft names only), ``None`` for a plain
    weight update; ``KeyError`` for adapter weights the engine cannot take."""
    adapter = [item for item in items if is_adapter_weight(item[0])]
    if not adapter:
        return None
    if len(adapter) != len(items) or not lora_enabled:
        raise KeyError(
            "LoRA adapter weights need rollout.lora.rank > 0 and a stream of adapter weights only"
        )
    return adapter


def adapter_config(lora: LoraConfig, base_model: str) -> dict[str, object]:
    targets = list(lora.target_modules)
    return {
        "peft_type": "LORA",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0,
        "target_modules": "all-linear" if targets == ["all-linear"] else targets,
        "bias": "none",
        "task_type": "CAUSAL_LM",
    }


def _publish_dir(root: Path, name: str, write: Callable[[Path], None]) -> Path:
    """``root/name`` filled by ``write`` in a temporary sibling and renamed into place."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    write(staging)
    if target.exists():  # the same version sent again
        shutil.rmtree(target)
    os.replace(staging, target)
    return target


def write_adapter(
    root: Path, version: int, tensors: Sequence[tuple[str, torch.Tensor]], config: dict[str, object]
) -> Path:
    """``root/v<version>`` holding a peft adapter; returns its path."""

    def write(directory: Path) -> None:
        weights = {name: t.contiguous() for name, t in tensors}
        save_file(weights, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))

    return _publish_dir(root, f"v{version}", write)


def write_weights_dir(
    root: Path, version: int, tensors: Sequence[tuple[str, torch.Tensor]]
) -> Path:
    """``root/v<version>`` holding the tensors as one safetensors file (HF names)."""

    def write(directory: Path) -> None:
        weights = {name: t.contiguous() for name, t in tensors}
        save_file(weights, str(directory / "model.safetensors"))

    return _publish_dir(root, f"v{version}", write)
