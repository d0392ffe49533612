"""The ``megatron`` engine: Megatron-Core ``GPTModel`` chunks under megatron's DDP, its
optimizer (optionally distributed), and its pipeline schedules, behind the api's Engine.

Loss normalisation follows the api's global-token contract, whatever the micro-batch count,
pipeline or data-parallel size: the loss function already divides by the mini-batch's global
token count, so megatron is told not to divide again (``calculate_per_token_loss``: the
schedule keeps each micro-batch's loss as returned and DDP *sums* gradients over data-parallel
ranks) and our ``finalize_model_grads`` hook never rescales by a token count.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api import (
    Batch,
    CheckpointInfo,
    EngineConfig,
    EngineStateError,
    LossContext,
    LossFn,
    NamedTensor,
    OutputSpec,
    ParallelInfo,
    StepResult,
    merge_metrics,
)
from drivetrain.api.columns import ENTROPY, INPUT_IDS, LOG_PROBS, ROUTED_EXPERTS, VALUES
from drivetrain.api.config import coerce_config
from drivetrain.api.routing import NOT_RECORDED
from drivetrain.engine.megatron import checkpoint
from drivetrain.engine.megatron.config import MegatronConfig
from drivetrain.engine.megatron.context import gather_outputs, pack_row_cp
from drivetrain.engine.megatron.offload import Offloader
from drivetrain.engine.megatron.packing import align_to_inputs, pack_row
from drivetrain.engine.megatron.parallel import init_parallel, release_groups
from drivetrain.engine.megatron.routing import Routing
from drivetrain.engine.megatron.token_outputs import vocab_parallel_outputs
from drivetrain.engine_core import (
    InferOutputs,
    TorchCollectives,
    flat_column,
    loss_free_batch,
    on_device,
    to_layout,
)
from drivetrain.engine_core.base import TorchEngine
from drivetrain.engine_core.packed_kernels import engine_kernel
from drivetrain.runtime.devices import resolve_device
from drivetrain.runtime.micro_batching import loss_totals, plan_micro_batches
from drivetrain.runtime.schedule import lr_multiplier

log = logging.getLogger(__name__)


class MegatronEngine(TorchEngine):
    config: MegatronConfig
    #: close() destroys the process groups initialize() built (parallel.release_groups)
    releases_groups = True
    #: MoE routers take a batch's ``routed_experts`` and report the experts used (routing.py)
    replays_routing = True
    _said_host = False  # the CPU no-op offload is logged once

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(coerce_config(config, MegatronConfig))
        self.model: list[Any] = []

    # ---- life cycle ---------------------------------------------------------------------
    def initialize(self) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoConfig

        from drivetrain.engine.megatron.convert import load_hf_weights
        from drivetrain.engine.megatron.model import build_model, transformer_config

        cfg = self.config
        self.device = resolve_device(cfg.device, kinds=("cpu", "cuda"))  # megatron-core's
        self._groups = init_parallel(
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            virtual_pipeline=cfg.virtual_pipeline if cfg.virtual_pipeline > 1 else None,
            context_parallel=cfg.context_parallel,
            expert_parallel=cfg.expert_parallel,
            expert_tensor_parallel=cfg.expert_tensor_parallel,
            device=self.device.type,
            seed=cfg.seed,
        )
        self.ps = ps
        self.collectives = TorchCollectives(self.device, ps.get_data_parallel_group())
        self.hf_config = AutoConfig.from_pretrained(cfg.model.path)
        tcfg = transformer_config(
            self.hf_config,
            dtype=getattr(torch, cfg.model.dtype),
            tensor_parallel=cfg.tensor_parallel,
            pipeline_parallel=cfg.pipeline_parallel,
            virtual_pipeline=cfg.virtual_pipeline if cfg.virtual_pipeline > 1 else None,
            context_parallel=cfg.context_parallel,
            sequence_parallel=cfg.sequence_parallel,
            recompute=cfg.model.gradient_checkpointing,
            device=self.device.type,
            expert_parallel=cfg.expert_parallel,
            expert_tensor_parallel=cfg.expert_tensor_parallel,
        )
        # see the module docstring: our losses are normalised already, megatron must not rescale
        tcfg.calculate_per_token_loss = True
        tcfg.variable_seq_lengths = True  # packed rows differ in length between micro-batches
        tcfg.finalize_model_grads_func = lambda chunks, num_tokens=None, **_: finalize_model_grads(
            chunks
        )
        self.tcfg = tcfg
        self.packed_kernel = engine_kernel(
            cfg.packed_kernel,
            self.device.type,
            cfg.model.dtype,
            say=cfg.context_parallel == 1 and dist.get_rank() == 0,
        )
        chunks = build_model(
            self.hf_config, tcfg, value_head=cfg.model.value_head, packed_kernel=self.packed_kernel
        )
        for chunk in chunks:
            chunk.to(self.device)
        load_hf_weights(chunks, cfg.model.path, self.hf_config, tcfg)
        self.model = self._wrap_chunks(chunks)
        self.routing = Routing(chunks, tcfg, ps)  # chunk i of self.model wraps chunks[i]
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.lr * o.min_lr_ratio,
                weight_decay=o.weight_decay,
                adam_beta1=o.betas[0],
                adam_beta2=o.betas[1],
                adam_eps=o.eps,
                clip_grad=o.clip_grad or 0.0,
                bf16=cfg.model.dtype == "bfloat16",
                fp16=cfg.model.dtype == "float16",
                params_dtype=getattr(torch, cfg.model.dtype),
                use_distributed_optimizer=cfg.distributed_optimizer,
            ),
            self.model,
        )
        self.offloader = Offloader(self.model, self.optimizer, self.device)
        self.step = 0
        self._set_lr()
        self._place(None)

    # ---- extension points (engine-megatron-fsdp wraps the chunks differently) -------------
    def _wrap_chunks(self, chunks: list[Any]) -> list[Any]:
        """The data-parallel wrapper of each model chunk: megatron's DDP (the optimizer built
        next reads its ``ddp_config``)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=self.config.distributed_optimizer,
        )
        return [
            DistributedDataParallel(config=self.tcfg, ddp_config=ddp_config, module=chunk)
            for chunk in chunks
        ]

    def _sync_params(self) -> None:
        """Called before every read of the weights outside a training step (forward-only
        passes, export, checkpoints): a wrapper that gathers parameters asynchronously must
        finish that for *every* chunk here. megatron's DDP gathers synchronously: nothing."""

    def _export_params(self, chunk: Any) -> Mapping[str, torch.Tensor]:
        """This rank's tensor-parallel parameters of one bare ``GPTModel`` chunk by name, as
        the HF exporter reads them (one at a time, in the same order on every rank)."""
        return {name: p.detach() for name, p in chunk.named_parameters()}

    def _initialized(self) -> bool:
        return bool(self.model)

    def close(self) -> None:
        """Drop the model and destroy megatron's model-parallel groups; the process group stays
        (it belongs to the launcher, and other engines of this process may use it)."""
        if self.model:
            self.model = []
            self.optimizer = None
            self.collectives = None  # it holds megatron's data-parallel group
            self.ps.destroy_model_parallel()
            if self.releases_groups:
                release_groups(self._groups)

    @property
    def parallel(self) -> ParallelInfo:
        ps, cfg = self.ps, self.config
        last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        return ParallelInfo(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            dp_rank=ps.get_data_parallel_rank(),
            dp_size=ps.get_data_parallel_world_size(),
            is_output_rank=last_stage
            and ps.get_tensor_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0,
            sizes={
                "tp": cfg.tensor_parallel,
                "pp": cfg.pipeline_parallel,
                "vpp": cfg.virtual_pipeline,
                "cp": cfg.context_parallel,
                "ep": cfg.expert_parallel,
            },
        )

    def _modules(self) -> list[Any]:
        return self.model

    def _move(self, *, to_host: bool, model: bool, optimizer: bool) -> None:
        """Parameters + gradient buffers (``model``) and optimizer state to host memory or
        back; see ``offload.py``. On a CPU engine the compute device is the host: nothing
        moves (logged once)."""
        if self.device.type == "cpu":
            if to_host and not self._said_host:
                log.info("megatron engine on CPU: offload is a no-op (state already in host RAM)")
                self._said_host = True
            return
        if to_host:
            self.offloader.offload(model=model, optimizer=optimizer)
        else:
            self.offloader.reload(model=model, optimizer=optimizer)

    # ---- data ---------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        """Index groups, the same count on every rank (the pipeline schedule's collectives
        must line up); a rank that cannot cut its shard fails every rank."""
        return plan_micro_batches(batch, self.config.micro_batch, self.collectives)

    def _rows(self, batch: Batch, parts: list[list[int]]) -> list[tuple[Batch | None, Any]]:
        """Each micro-batch with its packed row; an empty group (a short shard) runs a one-token
        loss-free row so the schedule's collectives line up."""
        cfg = self.config
        multiple = cfg.tensor_parallel if cfg.sequence_parallel else 1
        empty = loss_free_batch(1, self.device)
        micros = [on_device(batch.select(i), self.device) if i else None for i in parts]
        if cfg.context_parallel > 1:
            rank = self.ps.get_context_parallel_rank()
            return [
                (
                    micro,
                    pack_row_cp(
                        flat_column(micro or empty, INPUT_IDS).to(self.device, torch.long),
                        list((micro or empty).seq_lens),
                        cp=cfg.context_parallel,
                        rank=rank,
                        multiple=multiple,
                    ),
                )
                for micro in micros
            ]
        lengths = [None] * len(micros)
        if (
            self.tcfg.num_moe_experts
            and self.ps.get_expert_tensor_and_model_parallel_world_size() > 1
        ):
            lengths = self._common_lengths(micros, empty, multiple)
        if self.config.virtual_pipeline > 1:
            # megatron's interleaved schedule sends every micro-batch's activations with one
            # shape (it ignores variable_seq_lengths): pad every row to the longest
            lengths = [max(self._common_lengths(micros, empty, multiple))] * len(micros)
        return [
            (micro, pack_row(micro or empty, self.device, multiple, length=length))
            for micro, length in zip(micros, lengths, strict=True)
        ]

    def _common_lengths(self, micros: list[Batch | None], empty: Batch, multiple: int) -> list[int]:
        """megatron's all-gather token dispatcher needs the same token count on every rank of
        the expert tensor x expert parallel group, which spans data-parallel ranks with rows of
        different lengths: pad each micro-batch's row to the longest across ranks (the padding
        is a separate, loss-free segment, and no token is ever dropped, so it changes nothing)."""
        need = [sum((m or empty).seq_lens) for m in micros]
        need = [n + ((-n) % multiple if n else multiple) for n in need]
        longest = torch.tensor(need, dtype=torch.long, device=self.device)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        return longest.tolist()

    # ---- compute ------------------------------------------------------------------------
    def _outputs(
        self, output: torch.Tensor, row: Any, micro: Batch, spec: OutputSpec
    ) -> dict[str, torch.Tensor]:
        """Requested per-token columns from the last stage's output ``[1, T, V/tp]``."""
        self._check_outputs(spec)
        if spec.values:
            values = self._gather_cp(output[0, :, 0].float(), row)
            out = {VALUES: to_layout(values[: row.num_tokens], micro)}
        else:
            log_probs, entropy = vocab_parallel_outputs(
                output[0],
                row.targets,
                vocab_size=self.hf_config.vocab_size,
                temperature=spec.temperature,
                want_entropy=spec.entropy,
            )
            raw = {LOG_PROBS: log_probs, ENTROPY: entropy}
            out = {
                name: to_layout(align_to_inputs(self._gather_cp(raw[name], row), row), micro)
                for name in (LOG_PROBS, ENTROPY)
                if name in spec.names
            }
        if spec.routed_experts:  # about each token itself, not the token it predicts
            out[ROUTED_EXPERTS] = to_layout(self.routing.used(row), micro, fill=NOT_RECORDED)
        return out

    def _gather_cp(self, local: torch.Tensor, row: Any) -> torch.Tensor:
        """Context parallel: this rank's per-token values -> the whole micro-batch's, in the
        original order (every CP rank then computes the same loss; see ``context.py``)."""
        if self.config.context_parallel == 1:
            return local
        group = self.ps.get_context_parallel_group()
        return gather_outputs(local, list(row.lengths), list(row.padded), group)

    def _schedule(
        self,
        rows: list[tuple[Batch | None, Any]],
        on_output: Any,
        *,
        forward_only: bool,
    ) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator: Iterator[Any], model: Any) -> tuple[torch.Tensor, Any]:
            micro, row = next(data_iterator)
            extra = {}
            if self.config.context_parallel > 1:  # TE's packed (thd) attention over CP ranks
                extra["packed_seq_params"] = row.packed_seq_params
            self.routing.before_forward(self.model.index(model), micro, row)
            output = model(row.input_ids, row.position_ids, row.attention_mask, **extra)
            return output, partial(on_output, micro, row)

        vp = self.config.virtual_pipeline
        iterators: Any = [iter(rows) for _ in range(vp)] if vp > 1 else iter(rows)
        self.routing.start(recompute=not forward_only and bool(self.tcfg.recompute_granularity))
        try:
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators,
                model=self.model if vp > 1 else self.model[0],
                num_microbatches=len(rows),
                seq_length=max(r.input_ids.shape[1] for _, r in rows),  # local share under CP
                micro_batch_size=1,
                forward_only=forward_only,
            )
        finally:
            self.routing.finish()

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, outputs: OutputSpec | None = None
    ) -> StepResult:
        self._require("train", "forward_backward")
        spec = self._training_outputs(outputs)
        self.routing.check(batch, spec)
        totals = loss_totals(batch, self.collectives)
        parts = self._micro_batches(batch)
        dp_size = self.ps.get_data_parallel_world_size()
        index = iter(range(len(parts)))

        def on_output(micro: Batch | None, row: Any, output: torch.Tensor) -> tuple[Any, ...]:
            k = next(index)
            if micro is None:  # an empty micro-batch of a short shard: zero loss, zero grads
                return output.sum() * 0.0, torch.tensor(0), {"loss": 0.0}
            ctx = LossContext(totals.tokens, totals.sequences, dp_size, k, len(parts))
            loss, metrics = loss_fn(self._outputs(output, row, micro, spec), micro, ctx)
            report = {"loss": float(loss.detach()), **{n: float(v) for n, v in metrics.items()}}
            return loss, torch.tensor(1), report

        reports = self._schedule(self._rows(batch, parts), on_output, forward_only=False)
        loss, metrics = self._sum_reports(reports)
        return StepResult(loss, metrics, len(parts), totals.tokens)

    def _sum_reports(self, reports: list[Mapping[str, float]]) -> tuple[float, dict[str, float]]:
        """Totals over micro-batches and data-parallel ranks, the same on every rank (only the
        output ranks, one per data-parallel rank, computed losses)."""
        totals: dict[str, float] = {}
        if self.parallel.is_output_rank:
            for report in reports:
                merge_metrics(totals, report)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.parallel.is_output_rank, totals))
        summed: dict[str, float] = {}
        for is_output, values in gathered:
            if is_output:
                merge_metrics(summed, values)
        loss = summed.pop("loss", 0.0)
        return loss, summed

    def infer(self, batch: Batch, outputs: OutputSpec) -> Batch | None:
        self._require("eval", "infer")
        self._sync_params()
        self.routing.check(batch, outputs)
        parts = self._micro_batches(batch)
        collected = InferOutputs(batch)
        indices = iter(parts)

        def on_output(micro: Batch | None, row: Any, output: torch.Tensor) -> tuple[Any, ...]:
            taken = next(indices)
            if micro is not None:
                collected.add(taken, micro, self._outputs(output, row, micro, outputs))
            return output.sum() * 0.0, torch.tensor(0), {}

        with torch.no_grad():
            self._schedule(self._rows(batch, parts), on_output, forward_only=True)
        return collected.result(outputs.names) if self.parallel.is_output_rank else None

    # ---- optimizer ----------------------------------------------------------------------
    def _set_lr(self) -> None:
        lr = self.config.optim.lr * lr_multiplier(self.step, self.config.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._lr = lr

    def optimizer_zero_grad(self) -> None:
        self._require("train", "optimizer_zero_grad")
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def optimizer_step(self) -> float:
        self._require("train", "optimizer_step")
        # the norm before clipping, also when clipping is off (megatron then reports none);
        # a non-finite norm skips the update and leaves the weights as they are
        found_inf = self.optimizer.prepare_grads()
        norm = float("inf") if found_inf else float(self.optimizer.get_grad_norm())
        if not math.isfinite(norm):
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            return norm
        self.optimizer.step()
        return norm

    def lr_scheduler_step(self) -> float:
        self._require("train", "lr_scheduler_step")
        self.step += 1
        self._set_lr()
        return self._lr

    # ---- weights and checkpoints --------------------------------------------------------
    def export_weights(self, *, adapter_only: bool = False) -> Iterator[NamedTensor]:
        if adapter_only:
            raise EngineStateError("the megatron engine has no LoRA adapter")
        return self._export()

    def _export(self) -> Iterator[NamedTensor]:
        from drivetrain.engine.megatron.convert import export_hf_weights

        with self._resident(optimizer=False):
            self._sync_params()
            chunks = [chunk.module for chunk in self.model]
            yield from export_hf_weights(
                chunks, self.hf_config, self.tcfg, read_params=self._export_params
            )

    def save_checkpoint(self, path: str, *, step: int) -> CheckpointInfo:
        with self._resident(optimizer=True):
            self._sync_params()
            return checkpoint.save(path, step=step, engine=self)

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        with self._resident(optimizer=True):
            info = checkpoint.load(path, engine=self)
        self._set_lr()
        return info
