"""Write a Hugging Face model directory from any engine's ``export_weights()`` stream.

The trainer does this, not the engine, so every engine gets the same loadable output
(safetensors shards + index, the source model's config and tokenizer files) from the one
streaming contract, and at most one shard is held in memory at a time.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from drivetrain.api import NamedTensor
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.runtime.manifest import ManifestError, has_manifest, verify_manifest, write_manifest
from drivetrain.trainer.errors import DataError

#: Files copied from the source model directory next to the weights, when present.
COMPANION_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def write_hf_model(
    path: str,
    weights: Iterator[NamedTensor],
    *,
    source_dir: str,
    adapter_config: Mapping[str, Any] | None = None,
    writer: bool = True,
    max_shard_bytes: int = 2 * 1024**3,
) -> None:
    """Consume ``weights`` (every rank must: it may be collective); the ``writer`` writes."""
    from safetensors.torch import save_file

    target = Path(path).absolute()
    staging = staging_path(target)
    shards: list[tuple[str, list[str]]] = []
    shard: dict[str, Any] = {}
    size = total = 0
    if writer:
        staging.mkdir(parents=True)

    def flush() -> None:
        nonlocal shard, size
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            shards.append((name, list(shard)))
        shard, size = {}, 0

    try:
        seen: set[str] = set()
        for name, tensor in weights:
            if not writer:
                continue
            if name in seen:
                raise ValueError(f"weight {name!r} exported twice")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > max_shard_bytes:
                flush()
            shard[name] = tensor.detach().to("cpu").contiguous()
            size += nbytes
            total += nbytes
        if not writer:
            return
        flush()
        _finish(staging, shards, total, Path(source_dir), adapter_config)
        write_manifest(staging)
        publish(staging, target)
    except BaseException:
        if writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def _finish(
    staging: Path,
    shards: list[tuple[str, list[str]]],
    total: int,
    source: Path,
    adapter_config: Mapping[str, Any] | None,
) -> None:
    if len(shards) == 1:
        (staging / shards[0][0]).rename(staging / "model.safetensors")
    else:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: file for file, names in shards for n in names},
        }
        (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for name in COMPANION_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staging / name)
    if adapter_config is not None:
        # Weights are merged; record which adapter they came from for provenance.
        (staging / "drivetrain_merged_adapter.json").write_text(
            json.dumps(dict(adapter_config), indent=2, default=str)
        )


def verify_model_dir(path: str) -> None:
    """A model directory we exported (it carries a manifest) must still hold what was written;
    other directories (a hub download, a user's model) are taken as they are. Files added later
    (a README, our cache's report) are allowed."""
    if path and has_manifest(path):
        try:
            verify_manifest(path, allow_extra=True)
        except ManifestError as exc:
            raise DataError(f"model {exc}") from None
