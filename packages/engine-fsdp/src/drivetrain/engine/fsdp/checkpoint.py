"""Atomic, resharding checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint directory::

    .metadata, __*_*.distcp    model + optimizer, sharded (DCP; loadable at any world size)
    extra_rank{r}.pt           LR scheduler, step, RNG states of rank r
    drivetrain.json            written last: step, world size, engine

All ranks write into ``.<name>.<id>.partial`` beside ``path`` and rank 0 renames it to ``path``
after everyone finished, so ``path`` is complete or absent even if a process dies mid-write.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from drivetrain.api import CheckpointInfo
from drivetrain.engine_core.dcp_metadata import metadata_read_once
from drivetrain.runtime.atomic_dir import publish, staging_path
from drivetrain.runtime.untrusted import torch_loads_weights_only

MARKER = "drivetrain.json"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save(
    path: str,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    engine: str,
) -> CheckpointInfo:
    target = Path(path).absolute()
    rank = dist.get_rank()
    name = [staging_path(target).name if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    staging = target.parent / str(name[0])
    if rank == 0:
        staging.mkdir(parents=True)
    dist.barrier()
    try:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging))
        extra = {"scheduler": scheduler.state_dict(), "step": step, "rng": _rng_state()}
        torch.save(extra, staging / f"extra_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            marker = {"step": step, "world_size": dist.get_world_size(), "engine": engine}
            with open(staging / MARKER, "w") as f:
                json.dump(marker, f)
                f.flush()
                os.fsync(f.fileno())
            publish(staging, target)
        dist.barrier()
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    return CheckpointInfo(str(target), step)


def is_complete(path: str) -> bool:
    return (Path(path) / MARKER).is_file()


def load(
    path: str,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> CheckpointInfo:
    source = Path(path).absolute()
    if not is_complete(str(source)):
        raise FileNotFoundError(f"{source} is not a complete drivetrain checkpoint (no {MARKER})")
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # DCP's .metadata from one checked read; its planner unpickles non-tensor entries
    with metadata_read_once(source), torch_loads_weights_only(source):
        dcp.load(state, checkpoint_id=str(source))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    extra_path = source / f"extra_rank{dist.get_rank()}.pt"
    if not extra_path.exists():  # saved at a smaller world size: rank 0's schedule and step
        extra_path = source / "extra_rank0.pt"
    with torch_loads_weights_only(extra_path):
        extra = torch.load(extra_path, weights_only=True)
    scheduler.load_state_dict(extra["scheduler"])
    _set_rng_state(extra["rng"])
    return CheckpointInfo(str(source), int(extra["step"]))
