"""The megatron engine's planner: the engine itself (megatron-core's GPTModel, its DDP buffers,
the distributed optimizer, the schedules, over tensor, pipeline and context parallel groups)
initialised and run for two optimizer steps on fake tensors, over a fake process group of the
target's size, with every live tensor's bytes counted (``plan_count.py``). The peak is taken in
the second step, which meets the optimizer state. It plans rank 0 (the first pipeline stage)
and, with pipeline parallel, the last rank too (the LM head's stage), and reports the busier.

Always in a child process (``engine_core.plan_child``): the fake group must be the default one
and megatron's parallel state and the patches below are the process's. The patches change what
fake tensors cannot run, never what is allocated: weights are not read (there are none);
``GPTModel.to`` moves nothing (fake parameters are on the host already); object collectives
hand every rank this rank's object; megatron's coalesced reduce-scatter runs as separate
collectives and its L2 norm in stock ops; the engine's host bookkeeping (micro-batch plans,
token counts, packed rows' offsets) runs on real tensors; layouts are scattered by integer
indices (a boolean mask made in fake mode has a data-dependent size); with pipeline parallel the
activation shapes a stage would send ahead are known (every micro-batch as long as the largest);
with context parallel TransformerEngine's ring attention (CUDA-only, absent here) is stood in
by one variable-length attention over the rank's ``T / cp`` tokens (its in-flight K/V buffers
are not counted). The packed kernel is the one ``auto`` picks on CUDA.

Measured against the H200 (``tests/test_plan.py``): the 1.07B dense configuration within 1%.
Not counted: the CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from drivetrain.api import MicroBatchConfig
from drivetrain.api.batch import Batch, Layout
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK, VALUES
from drivetrain.api.plan import MemoryPlan, RankWork
from drivetrain.engine.megatron.config import MegatronConfig


def plan_memory(config: MegatronConfig, world: int, work: RankWork) -> MemoryPlan:
    """The busier of the first and last pipeline stages' rank for ``work`` under ``config``
    over ``world`` ranks (each planned in a child process)."""
    from drivetrain.engine_core.plan_child import plan_in_child

    stages = ["first_stage"] + ["last_stage"] * (config.pipeline_parallel > 1)
    plans = [
        plan_in_child(f"drivetrain.engine.megatron.plan:plan_{stage}", config, world, work)
        for stage in stages
    ]
    return max(plans, key=lambda plan: plan.peak_bytes)


def plan_first_stage(config: MegatronConfig, world: int, work: RankWork) -> MemoryPlan:
    """Rank 0 in this process (a child's entry point: it must hold no process group)."""
    return _plan_rank(config, world, work, 0)


def plan_last_stage(config: MegatronConfig, world: int, work: RankWork) -> MemoryPlan:
    """The last rank (the last pipeline stage's) in this process."""
    return _plan_rank(config, world, work, world - 1)


def _plan_rank(config: MegatronConfig, world: int, work: RankWork, rank: int) -> MemoryPlan:
    if not work.train:
        raise NotImplementedError("the megatron planner plans training steps only")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from drivetrain.engine.megatron.engine import MegatronEngine
    from drivetrain.engine.megatron.plan_count import HostReads, LiveBytes

    batch, micro = _batch(config, work)
    config = dataclasses.replace(config, micro_batch=micro, device="cpu")
    count, rows = LiveBytes(), []
    with (
        _fake_world(world, rank),
        _patched(config, rows),
        FakeTensorMode(allow_non_fake_inputs=True),
        HostReads(),
        count,
    ):
        engine = MegatronEngine(config)
        engine.initialize()
        engine.collectives = _RealCalls(engine.collectives)
        for step in range(2):
            if step == 1:
                count.reset_peak()  # the second step holds the optimizer state
            with engine.train_mode():
                count.part = "temporary"
                engine.optimizer_zero_grad()
                count.part = "activations"
                engine.forward_backward(batch, _planned_loss)
                count.part = "optimizer"
                engine.optimizer_step()
    by_category = {k: v for k, v in count.peak_by_part.items() if v > 0}
    return MemoryPlan(
        engine="megatron",
        world_size=world,
        peak_bytes=count.peak,
        by_category=by_category,
        method=f"megatron's own engine on fake tensors (rank {rank}; live bytes in 512 B "
        "blocks); parameters: the bf16 weights, fp32 main weights and gradient buffer; not "
        "counted: the CUDA context, NCCL and cuBLAS workspaces, fragmentation",
    )


def _planned_loss(outputs: Any, micro_batch: Batch, ctx: Any) -> tuple[Any, dict]:
    """A loss over every scored token (log-probs, or a value head's values): what a step's
    backward holds does not depend on which."""
    scores = outputs[VALUES] if VALUES in outputs else outputs[LOG_PROBS]
    return -(scores * micro_batch[LOSS_MASK]).sum() / ctx.global_tokens, {}


def _batch(config: MegatronConfig, work: RankWork) -> tuple[Batch, MicroBatchConfig]:
    """The step's batch of ``work`` (token values do not matter) and its micro-batching:
    every micro-batch as large as the largest; two of them without pipeline parallel (the
    second meets the first's gradients); with it, up to twice the stages (1F1B holds at most
    one a stage in flight: more only repeat the steady state)."""
    count = min(work.micro_batches, 2 * config.pipeline_parallel)
    if work.documents:
        lengths = list(work.documents) * count
        micro = MicroBatchConfig(max_tokens=sum(work.documents))
    else:
        lengths = [work.width] * (work.rows * count)
        micro = MicroBatchConfig(micro_batch_size=work.rows)
    width = max(lengths)
    ids = torch.full((len(lengths), width), 3, dtype=torch.long)
    mask = torch.zeros(len(lengths), width)
    for i, n in enumerate(lengths):
        mask[i, 1:n] = 1.0
    return Batch.from_columns({"input_ids": ids, "loss_mask": mask}, seq_lens=lengths), micro


@contextlib.contextmanager
def _fake_world(world: int, rank: int) -> Iterator[None]:
    """A fake default group of ``world`` ranks, this process ``rank``; megatron's gloo
    groups made on the fake backend too (gloo cannot run over a fake store)."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    create = parallel_state.create_group

    def on_fake(
        ranks: Any = None, timeout: Any = None, backend: Any = None, *a: Any, **k: Any
    ) -> Any:
        return create(ranks, timeout, None if backend == "gloo" else backend, *a, **k)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with mock.patch.object(parallel_state, "create_group", on_fake):
            yield
    finally:
        dist.destroy_process_group()


def _real(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` on real tensors (host bookkeeping whose values the engine reads)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def call(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return call


class _RealCalls:
    """An object whose methods run on real tensors (the engine's bookkeeping collectives)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        return _real(value) if callable(value) else value


class _Uncoalesced:
    """torch's ``_coalescing_manager`` without its coalesced c10d ops (no fake kernels): the
    collectives inside run one by one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _Uncoalesced:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def wait(self) -> None:
        pass


def _l2_norm(chunk: Any, noop: Any, lists: Any, per_tensor: Any, *args: Any) -> Any:
    """megatron's local ``multi_tensor_l2norm`` in stock ops (the same few bytes)."""
    norms = [torch.linalg.vector_norm(t.float()) for group in lists for t in group]
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _to_layout(flat: torch.Tensor, batch: Batch, fill: Any = 0) -> torch.Tensor:
    """``engine_core.to_layout`` scattering by integer indices."""
    if batch.layout is Layout.PACKED:
        return flat
    out = flat.new_full((len(batch), batch["input_ids"].shape[1], *flat.shape[1:]), fill)
    rows, cols = _real(_positions)(batch.seq_lens)
    out[rows, cols] = flat
    return out


def _positions(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return rows, torch.cat([torch.arange(n) for n in lengths])


def _align_to_inputs(next_values: torch.Tensor, row: Any) -> torch.Tensor:
    """``packing.align_to_inputs`` with the documents' first positions chosen in Python."""
    shifted = torch.cat([next_values.new_zeros(1), next_values[:-1]])[: row.num_tokens]
    starts = _real(torch.tensor)([s for s in row.offsets[:-1] if s < row.num_tokens])
    keep = torch.ones_like(shifted)
    keep[starts] = 0
    return shifted * keep


@contextlib.contextmanager
def _patched(config: MegatronConfig, rows: list[int]) -> Iterator[None]:
    """What fake tensors cannot run, made runnable (the module docstring says each)."""
    from drivetrain.engine.megatron import convert, model
    from drivetrain.engine.megatron import engine as engine_module
    from drivetrain.engine.megatron.plan_count import fused_rms_norm_forward

    def packed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            row = _real(fn)(*args, **kwargs)
            rows.append(row.input_ids.shape[1])
            return row

        return call

    tp = config.tensor_parallel if config.sequence_parallel else 1
    hidden = _hidden(config)

    def stage_shape(*args: Any) -> tuple[list[int], list[int]]:
        shape = [max(rows) // tp, 1, hidden]
        return shape, shape

    kernel = "torch_varlen"  # what `auto` runs on CUDA (its memory: q, k, v, out, lse)
    patches = [
        mock.patch.object(engine_module, "to_layout", _to_layout),
        mock.patch.object(engine_module, "align_to_inputs", _align_to_inputs),
        mock.patch.object(engine_module, "loss_totals", _real(engine_module.loss_totals)),
        mock.patch.object(
            engine_module, "plan_micro_batches", _real(engine_module.plan_micro_batches)
        ),
        mock.patch.object(engine_module, "pack_row", packed(engine_module.pack_row)),
        mock.patch.object(engine_module, "pack_row_cp", packed(engine_module.pack_row_cp)),
        mock.patch.object(engine_module, "engine_kernel", lambda *a, **k: kernel),
        mock.patch.object(model.RMSNorm, "forward", fused_rms_norm_forward),
        mock.patch.object(convert, "load_hf_weights", lambda *a, **k: None),
        mock.patch("megatron.core.models.gpt.GPTModel.to", lambda self, *a, **k: self),
        mock.patch("megatron.core.optimizer.clip_grads.l2_norm_impl", _l2_norm),
        mock.patch(
            "megatron.core.distributed.param_and_grad_buffer._coalescing_manager", _Uncoalesced
        ),
        mock.patch(
            "megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator._communicate_shapes",
            stage_shape,
        ),
        mock.patch.object(
            dist,
            "all_gather_object",
            lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out)),
        ),
    ]
    if config.context_parallel > 1:
        from drivetrain.engine.megatron.plan_cp import context_parallel_patches

        patches += context_parallel_patches()
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def _hidden(config: MegatronConfig) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config.model.path).hidden_size
