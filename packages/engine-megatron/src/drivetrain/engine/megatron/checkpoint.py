"""Atomic checkpoints with ``megatron.core.dist_checkpointing``.

Layout of a checkpoint directory::

    (dist_checkpointing files)   model chunks + optimizer, as sharded tensors: loadable at
                                 another tensor/pipeline layout
    extra_rank{r}.pt             RNG states of rank r
    drivetrain.json              written last: step, layout, engine

All ranks write into ``.<name>.<id>.partial`` beside ``path``; rank 0 renames it to ``path``
after everyone finished, so ``path`` is complete or absent even if a process dies mid-write.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from drivetrain.api import CheckpointInfo
from drivetrain.engine.megatron.checkpoint_dir import (
    begin_save,
    finish_save,
    loading_safely,
    read_marker,
    restore_rank_extra,
)


def _sharded_state(engine: Any, *, loading: bool) -> dict[str, Any]:
    model = {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(engine.model)}
    # "fully_reshardable": a distributed optimizer's state saved per parameter, so it loads
    # at another tensor/pipeline/data-parallel layout
    optimizer = engine.optimizer.sharded_state_dict(
        model, is_loading=loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"}
    )
    return {**model, "optimizer": optimizer}


def _distributed_optimizers(optimizer: Any) -> list[Any]:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p for p in parts if hasattr(p, "_set_main_param_and_optimizer_states")]


@contextlib.contextmanager
def _adam_step_kept(optimizer: Any) -> Iterator[None]:
    """Work around megatron-core 0.16's fully-reshardable load with torch's Adam (used without
    TransformerEngine/Apex): it copies every per-parameter optimizer state into place, "step"
    included, but the checkpoint carries "step" only in the param groups (restored just before),
    so the copy raises ``KeyError: 'step'``. Each parameter is handed its own restored step."""
    patched = []
    for inner in _distributed_optimizers(optimizer):
        original = inner._set_main_param_and_optimizer_states

        def with_step(
            model_param: Any, tensors: dict, inner: Any = inner, original: Any = original
        ) -> Any:
            group, order = inner.model_param_group_index_map[model_param]
            main = inner.optimizer.param_groups[group]["params"][order]
            state = inner.optimizer.state.get(main, {})
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            return original(model_param, tensors)

        inner._set_main_param_and_optimizer_states = with_step
        patched.append(inner)
    try:
        yield
    finally:
        for inner in patched:
            del inner._set_main_param_and_optimizer_states  # back to the class's method


def save(path: str, *, step: int, engine: Any) -> CheckpointInfo:
    from megatron.core import dist_checkpointing

    target, staging = begin_save(path)
    dist_checkpointing.save(_sharded_state(engine, loading=False), str(staging))
    cfg = engine.config
    layout = {"tp": cfg.tensor_parallel, "pp": cfg.pipeline_parallel, "vpp": cfg.virtual_pipeline}
    meta = {"engine": "megatron", **layout}
    return finish_save(target, staging, step=step, engine_step=engine.step, meta=meta)


def _give_fresh_adam_state(optimizer: Any) -> None:
    """Loading needs a template of the optimizer state, and megatron-core 0.16's distributed
    optimizer reads one "step" from torch's Adam state (it asserts there is exactly one): an
    optimizer that never stepped has neither, so create zero moments and step 0."""
    for inner in _distributed_optimizers(optimizer):
        inner.init_state_fn(inner.optimizer, inner.config)
        for state in inner.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _unshare_adam_steps(optimizer: Any) -> None:
    """megatron-core 0.16 restores torch Adam's per-parameter "step" as *one* tensor shared by
    every parameter's state; Adam increments it in place once per parameter, so the next step's
    bias correction would use a step count of (number of parameters + 1). Give each its own."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        for state in getattr(torch_optimizer, "state", {}).values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()


def load(path: str, *, engine: Any) -> CheckpointInfo:
    from megatron.core import dist_checkpointing

    meta = read_marker(path)
    _give_fresh_adam_state(engine.optimizer)
    with loading_safely(path):
        state = dist_checkpointing.load(_sharded_state(engine, loading=True), path)
    for i, chunk in enumerate(engine.model):
        chunk.module.load_state_dict(state[f"model{i}"])
    with _adam_step_kept(engine.optimizer):
        engine.optimizer.load_state_dict(state["optimizer"])
    _unshare_adam_steps(engine.optimizer)
    saved_step = restore_rank_extra(path)
    engine.step = meta["step"] if saved_step is None else saved_step
    return CheckpointInfo(path, int(meta["step"]))
