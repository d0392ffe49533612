"""Atomic checkpoints of the sharded (DTensor) state with ``torch.distributed.checkpoint``.

Every parameter is saved under a layout-free name (``decoder.layers.<global layer>...``, not
the chunk-local index) as the DTensor Megatron-FSDP trains (its fp32 main weight, sharded
over data parallel and tensor parallel), with its Adam moments and step beside it. DCP reads
back any slice of any tensor, so a checkpoint loads at another data-parallel or pipeline layout
and another world size; a different tensor-parallel size is refused (fc1's per-rank
``[gate; up]`` blocks and the 128 x TP vocabulary padding are baked into the saved tensors).
Megatron-FSDP's shards are uneven; its ``preprocess_state_dict_for_uneven_dtensor`` gives DCP
each shard's true offsets.

Directory: DCP files, ``extra_rank{r}.pt`` (RNG), ``drivetrain.json`` (written last). All
ranks write into a staging directory that rank 0 renames to ``path`` once everyone finished.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from drivetrain.api import CheckpointInfo
from drivetrain.engine.megatron.checkpoint_dir import (
    begin_save,
    finish_save,
    loading_safely,
    read_marker,
    restore_rank_extra,
)

_ADAM = ("exp_avg", "exp_avg_sq")


def _global_names(chunk: Any) -> dict[str, Any]:
    """A bare ``GPTModel`` chunk's parameters under layout-free names."""
    named = {}
    for name, param in chunk.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(chunk.decoder.layers[int(parts[2])].layer_number - 1)
        named[".".join(parts)] = param
    return named


def _adam_states(engine: Any) -> dict[int, dict[str, Any]]:
    """torch Adam's state per parameter (by id), created empty where Adam has not stepped yet:
    loading needs a tensor of the right sharding to read into."""
    states = {}
    for inner in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state[param]
                for key in _ADAM:
                    state.setdefault(key, torch.zeros_like(param))
                state.setdefault("step", torch.tensor(0.0))
                states[id(param)] = state
    return states


def _agree_on_steps(engine: Any, optim: dict[str, dict[str, Any]]) -> None:
    """Make every parameter's Adam step count the same on all its data-parallel ranks.

    Megatron-FSDP shards the flat buffer, not each tensor: a rank whose shard holds no element
    of a parameter never steps it, so its step count stays 0 while its peers' is N. DCP saves a
    plain tensor once (deduplicated, any rank's copy), so without this a resume could restore
    0 and redo Adam's bias correction from the start (measured: 3.5e-3 off after one step)."""
    steps = torch.tensor([float(o["step"]) for o in optim.values()], dtype=torch.float64)
    group = engine.ps.get_data_parallel_group()
    if steps.numel():
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    for state, step in zip(optim.values(), steps.tolist(), strict=True):
        state["step"].fill_(step)


def _state(engine: Any) -> dict[str, Any]:
    from megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor

    adam = _adam_states(engine)
    model, optim = {}, {}
    for chunk in engine.model:
        for name, param in _global_names(chunk.module).items():
            model[name] = param
            optim[name] = {key: adam[id(param)][key] for key in (*_ADAM, "step")}
    _agree_on_steps(engine, optim)
    return preprocess_state_dict_for_uneven_dtensor({"model": model, "optim": optim})


def save(path: str, *, step: int, engine: Any) -> CheckpointInfo:
    target, staging = begin_save(path)
    dcp.save(_state(engine), checkpoint_id=str(staging))
    cfg = engine.config
    meta = {
        "engine": "megatron_fsdp",
        "tp": cfg.tensor_parallel,
        "pp": cfg.pipeline_parallel,
        "vpp": cfg.virtual_pipeline,
    }
    return finish_save(target, staging, step=step, engine_step=engine.step, meta=meta)


def load(path: str, *, engine: Any) -> CheckpointInfo:
    meta = read_marker(path)
    tp = engine.config.tensor_parallel
    if meta.get("tp", tp) != tp:
        # the tensor-parallel layout is part of the saved tensors: the gated MLP's fc1 holds
        # [gate; up] per TP rank and the vocabulary is padded to a multiple of 128 x TP
        raise ValueError(
            f"{path} was saved at tensor_parallel={meta['tp']}; the megatron_fsdp engine loads "
            f"it at another data-parallel or pipeline layout, but not at tensor_parallel={tp} "
            "(use engine megatron's checkpoints to change TP)"
        )
    with loading_safely(path):
        dcp.load(_state(engine), checkpoint_id=path)  # in place, into this layout's shards
    for chunk in engine.model:  # the training (model) weights from the loaded main weights
        chunk.install_optimized_model_weights()
    restore_rank_extra(path)
    engine.step = int(meta["step"])
    return CheckpointInfo(path, int(meta["step"]))
