"""LoRA adapter updates for engines that load adapters from a directory (vLLM, SGLang): the
stream's peft-named tensors are written as a peft adapter (safetensors + adapter_config.json)
into a fresh directory, assembled under a temporary name and renamed into place."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from drivetrain.api.config import LoraConfig

LORA_MARKERS = (".lora_A.", ".lora_B.")


def is_adapter_weight(name: str) -> bool:
    return any(marker in name for marker in LORA_MARKERS)


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


def write_adapter(
    root: Path, version: int, tensors: Sequence[tuple[str, torch.Tensor]], config: dict[str, object]
) -> Path:
    """``root/v<version>`` holding the adapter; returns its path."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"v{version}"
    staging = Path(tempfile.mkdtemp(prefix=f".v{version}.", dir=root))
    save_file(
        {name: t.contiguous() for name, t in tensors}, str(staging / "adapter_model.safetensors")
    )
    (staging / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if target.exists():  # the same version sent again
        shutil.rmtree(target)
    os.replace(staging, target)
    return target
