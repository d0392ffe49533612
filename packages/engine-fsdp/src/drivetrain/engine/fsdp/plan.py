"""The fsdp2 engine's planner: its own model, sharding, token outputs and optimizer code run on
fake tensors over a fake process group of the target's world size, with PyTorch's
``FSDPMemTracker`` counting every byte by category. Two steps of the largest
micro-batch: the second holds the optimizer state, the gradients and one micro-batch's
activations together, which is where a step peaks (fused AdamW's in-place update adds nothing
to it).

What fake tensors cannot answer is answered from what the planner knows of the batch:
transformers will not read a fake padding mask (it would build a dense mask instead of letting
SDPA run causal), and a boolean-mask index has a data-dependent size. Fake tensors live on the
CPU (fake CUDA needs a CUDA context here), so the device's own choices are made as on CUDA:
fused AdamW, and the packed kernel ``auto`` picks (``torch_varlen``: flash-attn keeps the same
tensors for backward). Not counted: the CUDA context, NCCL and cuBLAS workspaces, allocator
fragmentation (the caller's headroom).
Measured against the H200 (``tests/test_plan.py``): within 0.3% on both 1.07B configurations.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from drivetrain.api import OptimConfig
from drivetrain.api.batch import Batch
from drivetrain.api.errors import ConfigError
from drivetrain.api.plan import MemoryPlan, RankWork
from drivetrain.engine.fsdp.config import FSDPConfig

CATEGORIES = {  # FSDPMemTracker's names -> the plan's
    "Sharded Param": "parameters",
    "Unsharded Param": "unsharded_parameters",
    "Buffer": "buffers",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "unsharded_gradients",
    "Activation": "activations",
    "Temp": "temporary",
    "OptState": "optimizer",
    "Inputs": "inputs",
    "All Gather": "all_gather",
    "Reduce Scatter": "reduce_scatter",
}


class _KnownTokenCounts(TorchDispatchMode):
    """Boolean-mask indexing with a size the planner knows: every masked position is real."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.index.Tensor:
            masks = [i for i in args[1] if i is not None and i.dtype == torch.bool]
            if masks:
                source, (mask,) = args[0], masks
                return source.new_empty((mask.numel(), *source.shape[mask.dim() :]))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _fake_world(world: int) -> Iterator[Any]:
    """A fake process group of ``world`` ranks (this process rank 0) and its 1-D mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise ConfigError("planning needs a process without a process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:  # the mesh before fake mode: it reads its rank map
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


def _documents_row(work: RankWork) -> Any:
    """The packed row of ``work``'s documents (token values do not matter, only lengths)."""
    from drivetrain.engine.fsdp.packing import pack

    width = max(work.documents)
    ids = torch.full((len(work.documents), width), 3, dtype=torch.long)
    mask = torch.ones(len(work.documents), width)
    batch = Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=list(work.documents))
    return pack(batch, torch.device("cpu"))


def _forward_backward(
    model: Any, fake: Any, config: FSDPConfig, work: RankWork, row: Any, world: int
) -> None:
    """One micro-batch of ``work`` through the engine's model, forward and backward (forward
    only, without autograd, for a frozen role)."""
    with torch.set_grad_enabled(work.train):
        _micro_batch(model, fake, config, work, row, world)


def _micro_batch(
    model: Any, fake: Any, config: FSDPConfig, work: RankWork, row: Any, world: int
) -> None:
    from drivetrain.engine.fsdp.attention import set_packed_row

    if row is not None:
        kernel = "torch_varlen"  # what CUDA runs; grouped_sdpa groups by real lengths
        set_packed_row(row.spans, None, kernel)
        ids, pos, targets = (
            fake.from_tensor(t) for t in (row.input_ids, row.position_ids, row.targets)
        )
        out = model(ids[None], pos[None], targets, None, 1.0, False, None, None)
    else:
        ids = torch.zeros(work.rows, work.width, dtype=torch.long)
        pos = torch.arange(work.width).expand_as(ids)
        mask = torch.ones(work.rows, work.width, dtype=torch.long)
        targets = torch.zeros(work.rows * work.width, dtype=torch.long)
        out = model(ids, pos, targets, mask, 1.0, False)
    if work.train:
        scores = out["values"] if "values" in out else out["log_probs"]
        (-scores.sum() * world).backward()


def plan_memory(config: FSDPConfig, world: int, work: RankWork) -> MemoryPlan:
    """The busiest rank's memory for ``work`` under ``config`` over ``world`` ranks. A process
    that holds a process group of its own (a rank, a test worker) plans in a child process:
    the fake one must be the default group."""
    if dist.is_initialized():
        from drivetrain.engine_core.plan_child import plan_in_child

        return plan_in_child("drivetrain.engine.fsdp.plan:plan_here", config, world, work)
    return plan_here(config, world, work)


def plan_here(config: FSDPConfig, world: int, work: RankWork) -> MemoryPlan:
    """:func:`plan_memory` in this process (which must hold no process group)."""
    import transformers.masking_utils as masking
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from drivetrain.engine.fsdp.attention import NAME
    from drivetrain.engine.fsdp.model import TokenOutputModel
    from drivetrain.engine.fsdp.optim import build_optimizer
    from drivetrain.engine.fsdp.sharding import wrap_fsdp2

    for refused, why in (
        (config.ulysses_size > 1, "Ulysses sequence parallelism"),
        (config.strategy == "hybrid_shard", "hybrid_shard"),
        (config.model.lora.enabled, "LoRA"),
        (config.cpu_offload_policy, "cpu_offload_policy"),
    ):
        if refused:
            raise NotImplementedError(f"the fsdp2 planner does not model {why} yet")
    packed = config.attention == "varlen"
    if packed != bool(work.documents):
        raise ConfigError("attention='varlen' plans documents; other attention plans rows")
    value_head = config.model.value_head  # a critic or reward model: one value a token
    extra = {"num_labels": 1} if value_head else {}
    hf_config = AutoConfig.from_pretrained(config.model.path, **extra)
    hf_config.use_cache = False
    optim = OptimConfig(**{**config.optim.__dict__, "total_steps": 2})
    fake = FakeTensorMode()
    row = _documents_row(work) if packed else None
    # transformers reads the padding mask to skip the causal mask; the rows are full here
    full_rows = mock.patch.object(
        masking, "_ignore_causal_mask_sdpa", lambda mask, q_length, kv_length, *a, **k: True
    )
    with _fake_world(world) as mesh, fake, full_rows:
        auto = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
        hf = auto.from_config(
            hf_config,
            dtype=torch.float32,  # the master copy, as the engine loads it
            attn_implementation=NAME if packed else config.attention,
        )
        if config.model.gradient_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        module = TokenOutputModel(
            hf, value_head=value_head, logits_chunk=config.chunk_tokens(hf_config.vocab_size)
        )
        model = wrap_fsdp2(module, config, mesh, torch.device("cpu"))
        optimizer = None
        if work.train:
            optimizer, _ = build_optimizer(model, optim, torch.device("cuda"))  # fused, as on CUDA
            with _KnownTokenCounts():  # a first step outside the count: AdamW's state exists
                _forward_backward(model, fake, config, work, row, world)
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        tracker = FSDPMemTracker(model, optimizer)
        with tracker, _KnownTokenCounts():
            # a second micro-batch meets the first's gradients (accumulation). The optimizer
            # step is not counted: fused AdamW on a GPU updates in place, while its fake-tensor
            # run here goes through a path with full-size temporaries
            for _ in range(min(work.micro_batches, 2)):
                tracker.reset_mod_stats()  # one root forward per tracked iteration
                _forward_backward(model, fake, config, work, row, world)
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_category: dict[str, int] = {}
    for kind, value in peak.items():
        name = CATEGORIES.get(getattr(kind, "value", str(kind)))
        if name is not None and value:
            by_category[name] = by_category.get(name, 0) + int(value)
    total = next(int(v) for k, v in peak.items() if getattr(k, "value", str(k)) == "Total")
    return MemoryPlan(
        engine="fsdp2",
        world_size=world,
        peak_bytes=total,
        by_category=by_category,
        method="fsdp2's own model, sharding and optimizer on fake tensors (FSDPMemTracker); "
        "not counted: the CUDA context, NCCL and cuBLAS workspaces, fragmentation",
    )
