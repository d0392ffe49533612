"""Process group and Megatron-Core model-parallel state (torchrun's environment convention).

megatron-core keeps its process groups in module globals (``parallel_state``); everything it
builds afterwards (layers, schedules, the distributed optimizer) reads them from there, so this
is called once per process before a model is built.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def _init_process_group(device: str) -> None:
    kind = device.split(":")[0]
    if kind not in _BACKENDS:
        raise ValueError(f"device={device!r}: Megatron-Core runs on {', '.join(_BACKENDS)}")
    if kind == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    if dist.is_initialized():
        return
    # megatron-core sends host tensors too (object collectives, checkpoint metadata): on CUDA
    # the group also gets gloo so those never fail with "no backend for device type cpu"
    backend = "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:  # in-process use: a private world of one, no port needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def init_parallel(
    *,
    tensor_parallel: int,
    pipeline_parallel: int,
    virtual_pipeline: int | None,
    context_parallel: int,
    expert_parallel: int,
    device: str,
    seed: int,
    expert_tensor_parallel: int | None = None,
) -> list[dist.ProcessGroup]:
    """Join the torchrun world and build megatron-core's TP/PP/CP/EP/DP groups; returns the
    groups built, for :func:`release_groups` when their engine closes.

    Data parallel is what remains of the world. Experts have their own grid over the same
    ranks: ``expert_tensor_parallel`` (default: ``tensor_parallel``) x ``expert_parallel`` x
    pipeline x expert data parallel (the rest). ``seed`` seeds megatron's RNG tracker: the same
    stream on the ranks of a tensor-parallel group for replicated regions, a distinct one per
    TP rank for sharded ones (dropout inside TP regions, weight init)."""
    if device.split(":")[0] == "cpu":
        from drivetrain.engine.megatron import cpu_compat  # never imported on GPU runs

        cpu_compat.activate()
    _init_process_group(device)
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp

    world = dist.get_world_size()
    grid = tensor_parallel * pipeline_parallel * context_parallel
    if world % grid:
        raise ValueError(
            f"world size {world} is not divisible by tensor_parallel*pipeline_parallel*"
            f"context_parallel = {tensor_parallel}*{pipeline_parallel}*{context_parallel}"
        )
    if virtual_pipeline is not None and pipeline_parallel < 2:
        raise ValueError("virtual_pipeline needs pipeline_parallel >= 2")
    if parallel_state.model_parallel_is_initialized():
        # another engine's state: megatron's globals are replaced, its groups stay its own
        parallel_state.destroy_model_parallel()
    before = set(_registered_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel,
    )
    built = [pg for pg in _registered_groups() if pg not in before]
    # host RNG: use_cpu_initialization draws full weights on the host and then splits them,
    # so every rank of a TP group must draw the same numbers
    torch.manual_seed(seed)
    mcore_tp.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return built


def _registered_groups() -> list[dist.ProcessGroup]:
    """Every process group this rank belongs to, the default one excepted."""
    if not dist.is_initialized():
        return []
    world = dist.group.WORLD
    return [pg for pg in dist.distributed_c10d._world.pg_map if pg is not world]


def release_groups(groups: list[dist.ProcessGroup]) -> None:
    """Destroy the groups :func:`init_parallel` built for an engine that has closed (those
    still registered). megatron-core's ``destroy_model_parallel`` only forgets its globals:
    torch.distributed keeps the groups, and each gloo group its threads (a process that built
    engine after engine reached thousands of threads and a load average in the hundreds)."""
    registered = set(_registered_groups())
    for pg in groups:
        if pg in registered:
            dist.destroy_process_group(pg)
    # a gloo group's threads end with the group object, and the engine's modules (now garbage,
    # in reference cycles) still hold theirs: collect them now, not at some later allocation
    gc.collect()


def destroy_parallel() -> None:
    """Drop megatron-core's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
