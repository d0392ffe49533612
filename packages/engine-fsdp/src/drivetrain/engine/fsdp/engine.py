"""drivetrain's FSDP training engines: ``FSDP2Engine`` (``fully_shard``) and ``FSDP1Engine``.

The engine computes on packed rows (see :mod:`packing`), cuts mini-batches into micro-batches
itself (fixed size or token budget, the same count on every rank), scales the backward pass so
the accumulated gradient is the gradient of the summed losses whatever FSDP's averaging, and
returns outputs in the caller's layout and order. Modules: sharding, attention + Ulysses,
chunked token outputs, optimizer, offload, checkpoint and weight export live beside this file.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from drivetrain.api import (
    Batch,
    CheckpointInfo,
    ConfigError,
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
from drivetrain.engine.fsdp import checkpoint, offload, weights
from drivetrain.engine.fsdp.attention import set_packed_row
from drivetrain.engine.fsdp.config import FSDPConfig
from drivetrain.engine.fsdp.distributed import build_meshes, ensure_process_group
from drivetrain.engine.fsdp.model import (
    DTYPES,
    TokenOutputModel,
    compile_layers,
    exact_numerics,
    load_hf_model,
    unwrap_peft,
)
from drivetrain.engine.fsdp.optim import build_optimizer, clip_grad_norm
from drivetrain.engine.fsdp.packing import PackedRow, outputs_per_token, pack, row_routing
from drivetrain.engine.fsdp.sequence_parallel import gather_sequence, local_slice
from drivetrain.engine.fsdp.sharding import broadcast_from_rank0, wrap_fsdp1, wrap_fsdp2
from drivetrain.engine_core import (
    InferOutputs,
    TorchCollectives,
    flat_column,
    loss_free_batch,
    on_device,
    to_layout,
)
from drivetrain.engine_core.base import TorchEngine
from drivetrain.engine_core.moe_routing import RoutingRecorder, routing_hooks
from drivetrain.engine_core.op_trace import trace_modules
from drivetrain.engine_core.packed_kernels import engine_kernel
from drivetrain.runtime.devices import resolve_device
from drivetrain.runtime.micro_batching import loss_totals, plan_micro_batches


class FSDPEngine(TorchEngine):
    """Shared implementation; :class:`FSDP2Engine` and :class:`FSDP1Engine` pick the wrapper."""

    fsdp1: ClassVar[bool] = False
    replays_routing = True
    config: FSDPConfig

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(coerce_config(config, FSDPConfig))
        self.model: Any = None

    # ---- life cycle ---------------------------------------------------------------------
    def initialize(self) -> None:
        cfg = self.config
        if self.fsdp1 and cfg.cpu_offload_policy:
            raise ConfigError("cpu_offload_policy is FSDP2's; with FSDP1 use offload.params")
        self.device = resolve_device(cfg.device)
        ensure_process_group(self.device)
        torch.manual_seed(cfg.seed)  # identical init on every rank for new heads / adapters
        shard_size = {"hybrid_shard": cfg.hybrid_shard_size, "no_shard": 0 if self.fsdp1 else 1}
        self.meshes = build_meshes(self.device, cfg.ulysses_size, shard_size.get(cfg.strategy, 0))
        self.collectives = TorchCollectives(self.device, self.meshes.dp_group)
        rank0_loads = (
            self._shards() and not self.fsdp1 and dist.get_world_size() > 1 and cfg.meta_init
        )
        empty = rank0_loads and dist.get_rank() > 0  # built on meta, filled from rank 0
        hf = load_hf_model(cfg.model, cfg.attention, empty=empty)
        exact = cfg.numerics == "exact"
        self.packed_kernel = "grouped_sdpa"  # attention="varlen": what attends over a packed row
        if exact:
            self.packed_kernel = exact_numerics(hf, cfg, self.device, fsdp1=self.fsdp1)
        elif cfg.attention == "varlen":
            self.packed_kernel = engine_kernel(
                cfg.packed_kernel, self.device.type, cfg.model.dtype, say=dist.get_rank() == 0
            )
        self.hf_config = unwrap_peft(hf).config
        if cfg.torch_compile:
            compile_layers(hf)
        module = TokenOutputModel(
            hf,
            value_head=cfg.model.value_head,
            logits_chunk=cfg.chunk_tokens(self.hf_config.vocab_size),
            exact=exact,
        )
        # rank 0's full weights stay on the host until each rank takes its shard
        full = module.state_dict() if rank0_loads and not empty else None
        if not cfg.cpu_offload_policy and not empty:  # (FSDP2's offload policy wants host params)
            module.to(self.device)
        wrap = wrap_fsdp1 if self.fsdp1 else wrap_fsdp2
        self.model = wrap(module, cfg, self.meshes.fsdp, self.device) if self._shards() else module
        if rank0_loads:
            host = cfg.cpu_offload_policy
            broadcast_from_rank0(self.model, full, torch.device("cpu") if host else self.device)
        # under CPUOffloadPolicy the sharded parameters (and so the optimizer) live on the host
        optim_device = torch.device("cpu") if cfg.cpu_offload_policy else self.device
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, optim_device)
        lora = cfg.model.lora
        self._lora_scaling = lora.alpha / lora.rank if lora.enabled else None
        #: a micro-batch's router hooks, open until its backward ran (activation checkpointing
        #: recomputes the routers there: they must pick the replayed experts again)
        self._routing = contextlib.ExitStack()
        self._place(None)

    def _shards(self) -> bool:
        """Whether to wrap with FSDP. FSDP2 over a world of one only copies parameters and
        gradients through its buffers (~20% of a step here), so a single fp32 rank without
        an offload policy trains the plain module, as FSDP1 itself falls back to NO_SHARD."""
        cfg = self.config
        alone = dist.get_world_size() == 1 and cfg.model.dtype == "float32"
        return self.fsdp1 or not alone or cfg.cpu_offload_policy

    def close(self) -> None:
        self.model = self.optimizer = self.scheduler = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    @property
    def parallel(self) -> ParallelInfo:
        # before initialize() the layout follows from torchrun's environment and the config
        initialized = dist.is_initialized()
        world = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1))
        rank = dist.get_rank() if initialized else int(os.environ.get("RANK", 0))
        sp = self.config.ulysses_size
        return ParallelInfo(
            rank=rank,
            world_size=world,
            dp_rank=rank // sp,
            dp_size=world // sp,
            is_output_rank=rank % sp == 0,
            sizes={"dp": world // sp, "sp": sp},
        )

    @property
    def _inner(self) -> TokenOutputModel:
        return self.model.module if self.fsdp1 else self.model

    # ---- modes and placement ------------------------------------------------------------
    def _initialized(self) -> bool:
        return self.model is not None

    def _modules(self) -> list[torch.nn.Module]:
        return [self.model]

    def _move(self, *, to_host: bool, model: bool, optimizer: bool) -> None:
        if self.config.cpu_offload_policy:  # FSDP2 keeps parameters and optimizer on the host
            return
        target = torch.device("cpu") if to_host else self.device
        if model:
            offload.move_model(self.model, target, fsdp1=self.fsdp1)
        if optimizer:
            offload.move_optimizer(self.optimizer, target)
        if to_host:
            offload.release_device_memory(self.device)

    # ---- data ---------------------------------------------------------------------------
    def _micro_batches(self, batch: Batch) -> list[list[int]]:
        return plan_micro_batches(batch, self.config.micro_batch, self.collectives)

    def _dummy(self) -> Batch:
        """A loss-free micro-batch for ranks with fewer micro-batches than their peers (one
        token per sequence-parallel rank)."""
        return loss_free_batch(self.meshes.sp_size, self.device)

    # ---- compute ------------------------------------------------------------------------
    def _run_model(
        self, micro: Batch, spec: OutputSpec
    ) -> tuple[dict[str, torch.Tensor], PackedRow]:
        replay = ROUTED_EXPERTS in micro
        if not (replay or spec.routed_experts):
            return self._forward(micro, spec, None)
        if self.meshes.sp_size > 1:
            raise ConfigError("routing replay under Ulysses (ulysses_size > 1) is not supported")
        recorder = RoutingRecorder() if spec.routed_experts else None
        raw, row = self._forward(micro, spec, recorder)
        if recorder is not None:
            used = recorder.take()  # [rows as the routers saw them, layers, top_k]
            if not self.config.remove_padding:  # [samples x width]: the real tokens
                used = used.reshape(len(micro), -1, *used.shape[1:])
                used = torch.cat([used[i, :n] for i, n in enumerate(micro.seq_lens)])
            else:
                used = used[row.token_rows]
            raw[ROUTED_EXPERTS] = used
        return raw, row

    def _forward(
        self, micro: Batch, spec: OutputSpec, recorder: RoutingRecorder | None
    ) -> tuple[dict[str, torch.Tensor], PackedRow]:
        """The model on ``micro``: packed (or padded) row outputs, and the row. A batch with
        ``routed_experts`` makes the routers pick those experts; ``recorder`` gets the experts
        used."""
        cfg, m = self.config, self.meshes
        hf = unwrap_peft(self._inner.hf)
        if cfg.remove_padding:
            # extra outputs index the whole row: not under Ulysses, where a rank holds a slice
            share = cfg.share_prefixes and cfg.attention == "varlen" and m.sp_size == 1
            row = pack(micro, self.device, multiple=m.sp_size, share_prefixes=share)
            ids, pos, tgt = (
                local_slice(t, m.sp_group) for t in (row.input_ids, row.position_ids, row.targets)
            )
            set_packed_row(row.spans, m.sp_group, self.packed_kernel)
            replay = None
            if ROUTED_EXPERTS in micro:
                replay = row_routing(flat_column(micro, ROUTED_EXPERTS), row)
            self._hook_routers(hf, recorder, replay)
            raw = self.model(
                ids[None],
                pos[None],
                tgt,
                None,
                spec.temperature,
                spec.entropy,
                row.extra_src,
                row.extra_targets,
            )
            raw = {name: gather_sequence(value, m.sp_group) for name, value in raw.items()}
            return raw, row
        padded = micro.to_padded()
        row = pack(padded, self.device)
        ids = padded[INPUT_IDS].to(self.device)
        width = ids.shape[1]
        lens = torch.tensor(padded.seq_lens, device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] < lens[:, None]).long()
        positions = torch.arange(width, device=self.device).expand_as(ids)
        replay = None
        if ROUTED_EXPERTS in padded:  # [samples, width, ...] as the routers' [samples x width]
            replay = padded[ROUTED_EXPERTS].flatten(0, 1)
        self._hook_routers(hf, recorder, replay)
        raw = self.model(
            ids, positions, row.targets[: row.num_tokens], mask, spec.temperature, spec.entropy
        )
        return raw, row

    def _hook_routers(
        self, hf: torch.nn.Module, recorder: RoutingRecorder | None, replay: torch.Tensor | None
    ) -> None:
        """Router hooks for this micro-batch (until its backward: see ``self._routing``)."""
        if replay is not None or recorder is not None:
            self._routing.enter_context(routing_hooks(hf, record=recorder, replay=replay))

    def _outputs(self, micro: Batch, spec: OutputSpec) -> dict[str, torch.Tensor]:
        """The requested outputs for ``micro``, aligned with its inputs, in its layout."""
        self._check_outputs(spec)
        raw, row = self._run_model(micro, spec)
        wanted = {LOG_PROBS: "log_probs", ENTROPY: "entropy", VALUES: "values"}
        out = {
            column: to_layout(outputs_per_token(raw[key], row), micro)
            for column, key in wanted.items()
            if column in spec.names
        }
        if spec.routed_experts:  # about each token itself, not the token it predicts
            out[ROUTED_EXPERTS] = to_layout(raw[ROUTED_EXPERTS], micro, fill=NOT_RECORDED)
        return out

    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, outputs: OutputSpec | None = None
    ) -> StepResult:
        self._require("train", "forward_backward")
        spec = self._training_outputs(outputs)
        m = self.meshes
        totals = loss_totals(batch, self.collectives)
        parts = self._micro_batches(batch)
        # FSDP averages gradients over all ranks; the contract wants their sum over
        # data-parallel ranks (sequence-parallel peers each hold a slice of one gradient)
        scale = dist.get_world_size()
        loss_sum, metrics = 0.0, {}
        for k, indices in enumerate(parts):
            with self._routing:  # its router hooks end after its backward
                if not indices:
                    out = self._outputs(self._dummy(), spec)
                    (sum(v.float().sum() for v in out.values()) * 0.0).backward()
                    continue
                micro = on_device(batch.select(indices), self.device)
                ctx = LossContext(totals.tokens, totals.sequences, m.dp_size, k, len(parts))
                loss, mb_metrics = loss_fn(self._outputs(micro, spec), micro, ctx)
                (loss * scale).backward()
            loss_sum += float(loss.detach())
            merge_metrics(metrics, mb_metrics)
        loss_total, metric_totals = self._sum_over_dp(loss_sum, metrics)
        return StepResult(loss_total, metric_totals, len(parts), totals.tokens)

    def _sum_over_dp(
        self, loss: float, metrics: Mapping[str, float]
    ) -> tuple[float, dict[str, float]]:
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (self.meshes.sp_rank, loss, dict(metrics)))
        primary = [r for r in reports if r[0] == 0]  # sequence-parallel peers report the same
        totals: dict[str, float] = {}
        for _, _, values in primary:
            merge_metrics(totals, values)
        return sum(r[1] for r in primary), totals

    def infer(self, batch: Batch, outputs: OutputSpec) -> Batch | None:
        self._require("eval", "infer")
        collected = InferOutputs(batch)
        with torch.no_grad():
            for indices in self._micro_batches(batch):
                with self._routing:
                    if not indices:
                        self._outputs(self._dummy(), outputs)
                        continue
                    micro = on_device(batch.select(indices), self.device)
                    collected.add(indices, micro, self._outputs(micro, outputs))
        return collected.result(outputs.names) if self.parallel.is_output_rank else None

    def trace_ops(self, batch: Batch) -> Mapping[str, Any] | None:
        if len(batch) != 1:
            raise ValueError(f"trace_ops takes a batch of one sequence, got {len(batch)}")
        with trace_modules(unwrap_peft(self._inner.hf)) as trace:
            out = self.infer(batch, OutputSpec(log_probs=True))
        ops: dict[str, Any] = trace.outputs()
        if out is not None:
            ops["log_probs"] = out[LOG_PROBS][0].float()
        return ops

    def optimizer_zero_grad(self) -> None:
        self._require("train", "optimizer_zero_grad")
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        self._require("train", "optimizer_step")
        norm = clip_grad_norm(self.model, self.config.optim.clip_grad, fsdp1=self.fsdp1)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)  # skip the update, keep the weights
        return norm

    def lr_scheduler_step(self) -> float:
        self._require("train", "lr_scheduler_step")
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    # ---- weights and checkpoints --------------------------------------------------------
    def export_weights(self, *, adapter_only: bool = False) -> Iterator[NamedTensor]:
        if self.model is None:
            raise EngineStateError("call initialize() first")
        if adapter_only and self._lora_scaling is None:
            raise EngineStateError("adapter_only export needs LoRA (model.lora.rank > 0)")
        return self._export(adapter_only)

    def _export(self, adapter_only: bool) -> Iterator[NamedTensor]:
        with self._resident():
            yield from weights.export_stream(
                self.model,
                fsdp1=self.fsdp1,
                dtype=DTYPES[self.config.model.dtype],
                lora_scaling=self._lora_scaling,
                adapter_only=adapter_only,
            )

    def adapter_config(self) -> Mapping[str, Any] | None:
        if self._lora_scaling is None:
            return None
        config = self._inner.hf.peft_config["default"].to_dict()
        return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}

    def disable_adapter(self) -> AbstractContextManager[None]:
        if self._lora_scaling is None:
            return super().disable_adapter()
        return self._inner.hf.disable_adapter()

    def save_checkpoint(self, path: str, *, step: int) -> CheckpointInfo:
        if self.model is None:
            raise EngineStateError("call initialize() first")
        name = "fsdp" if self.fsdp1 else "fsdp2"
        with self._resident():
            return checkpoint.save(
                path,
                step=step,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                engine=name,
            )

    def load_checkpoint(self, path: str) -> CheckpointInfo:
        if self.model is None:
            raise EngineStateError("call initialize() before load_checkpoint()")
        with self._resident():
            return checkpoint.load(
                path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler
            )


class FSDP2Engine(FSDPEngine):
    fsdp1 = False


class FSDP1Engine(FSDPEngine):
    fsdp1 = True
