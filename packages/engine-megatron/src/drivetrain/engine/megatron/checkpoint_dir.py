"""The checkpoint directory protocol shared by the Megatron engines (engine-megatron and
engine-megatron-fsdp): every rank writes into one staging directory, each rank its RNG states
(Python, torch, CUDA and megatron's tensor-parallel tracker) beside the tensors, and rank 0
writes the marker last and renames the directory into place, so a killed save never looks
complete."""

from __future__ import annotations

import contextlib
import json
import random
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from drivetrain.api import CheckpointInfo
from drivetrain.engine_core.dcp_metadata import metadata_read_once
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.runtime.untrusted import torch_loads_weights_only

MARKER = "drivetrain.json"


def begin_save(path: str) -> tuple[Path, Path]:
    """``(target, staging)``: the staging directory every rank writes into (made by rank 0)."""
    target = Path(path).absolute()
    name = [staging_path(target).name if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    staging = target.parent / str(name[0])
    if dist.get_rank() == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    dist.barrier()
    return target, staging


def finish_save(
    target: Path, staging: Path, *, step: int, engine_step: int, meta: Mapping[str, Any]
) -> CheckpointInfo:
    """After the tensors are written: each rank's RNG state, then rank 0's marker and rename."""
    rank = dist.get_rank()
    rng = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        # the tensor-parallel regions' generators (attention dropout runs on one of them)
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"rng": rng, "step": engine_step}, staging / f"extra_rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        (staging / MARKER).write_text(json.dumps({"step": step, **meta}))
        publish(staging, target)
    dist.barrier()
    return CheckpointInfo(str(target), step)


def read_marker(path: str) -> dict[str, Any]:
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise FileNotFoundError(f"{path} is not a complete drivetrain checkpoint (no {MARKER})")
    return json.loads(marker.read_text())


@contextlib.contextmanager
def loading_safely(path: str) -> Iterator[None]:
    """Around a checkpoint load: DCP's ``.metadata`` (which torch and megatron-core unpickle) is
    read once, checked against the manifest and unpickled through an allow-list, and every
    reader gets that object; every ``torch.load`` inside is weights-only. So a checkpoint
    directory cannot run code, not even by swapping a file between a check and a read."""
    with metadata_read_once(path), torch_loads_weights_only(path):
        yield


def restore_rank_extra(path: str) -> int | None:
    """This rank's RNG state, and its saved step; ``None`` when the checkpoint was written at a
    smaller world size (no file for this rank: its RNG stays as seeded)."""
    extra_file = Path(path) / f"extra_rank{dist.get_rank()}.pt"
    if not extra_file.is_file():
        return None
    with torch_loads_weights_only(extra_file):
        extra = torch.load(extra_file, weights_only=True)
    random.setstate(extra["rng"]["python"])
    torch.set_rng_state(extra["rng"]["torch"])
    if "tracker" in extra["rng"]:  # absent in checkpoints saved before it was kept
        tensor_parallel.get_cuda_rng_tracker().set_states(extra["rng"]["tracker"])
    if "cuda" in extra["rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state(extra["rng"]["cuda"])
    return int(extra["step"])
