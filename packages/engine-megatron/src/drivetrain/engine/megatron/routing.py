"""Routing replay on megatron-core's routers: make each MoE layer use the experts a batch's
``routed_experts`` column names, and report the experts each forward used.

megatron-core's ``TopKRouter`` computes its top-k through ``router_replay.get_replay_topk(
scores, topk, num_groups, group_topk, default_compute_topk)`` whenever ``router_replay`` is set
(``moe_utils.topk_routing_with_score_function``; the fused router path skips it, and drivetrain
never fuses). ``scores`` are the router's logits (renormalised top-k: megatron then softmaxes
the k picked ones) or its softmax over all experts (un-normalised), so replaying an index means
taking the row's score at that expert: the router still learns through the gathered scores, as
in megatron-core's ``RouterReplay`` and verl's R2/R3.

megatron-core's own ``RouterReplay`` does not fit here: it keeps a process-wide list of
instances (two engines in one process mix their layers), gathers at -1 (a token nobody
recorded) and needs its caller to switch it to a backward mode for activation recompute. So
every router gets a :class:`Replayer` of its own, which

- computes the router's own choice, and uses the target's experts on rows that have them (a
  row whose first pick is -1 keeps the own choice);
- under full activation recompute, where megatron runs each layer's forward again during the
  backward, replays the same micro-batch's targets again: recomputes come in forward order
  (megatron's schedules run backwards micro-batch after micro-batch, in forward order), so a
  FIFO per router pairs them. A recompute is told apart from a first forward by grad mode:
  megatron's ``CheckpointFunction`` runs the first forward under ``no_grad`` and the recompute
  under ``enable_grad``.

Which rows a router sees: the micro-batch's packed row (samples back to back, then padding;
``b = 1``), flattened ``[s, b]``. Sequence parallel splits the row contiguously over the
tensor-parallel ranks; context parallel gives each rank :func:`~.context.chunk_index` of the
padded row (then split over TP); expert parallel dispatches tokens only after routing. Every
layer of a supported model is sparse and ``router.layer_number`` is global and 1-based: a
pipeline stage's routers index the column's layer dimension by it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from drivetrain.api import Batch, ConfigError, OutputSpec
from drivetrain.api.columns import ROUTED_EXPERTS
from drivetrain.api.routing import NOT_RECORDED
from drivetrain.engine.megatron.context import ContextParallelRow, chunk_index, real_positions
from drivetrain.engine_core import flat_column

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Replayer:
    """One router's replay: duck-types megatron-core's ``RouterReplay.get_replay_topk``."""

    def __init__(self, layer: int) -> None:
        self.layer = layer  # global, 0-based: the column's layer index
        self.target: torch.Tensor | None = None  # [rows, top_k] for the next forward, or None
        self.recompute = False  # this schedule recomputes activations in its backward
        self.pending: deque[torch.Tensor | None] = deque()  # targets awaiting their recompute
        self.used: torch.Tensor | None = None  # [rows, top_k] the last forward's experts

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores at the experts used, experts used)``, both ``[rows, topk]``."""
        assert default_compute_topk is not None  # megatron-core always passes its own top-k
        again = self.recompute and torch.is_grad_enabled()
        if again:
            if not self.pending:
                raise RuntimeError(f"router {self.layer}: an activation recompute without forward")
            target = self.pending.popleft()
        else:
            target = self.target
            if self.recompute:
                self.pending.append(target)
        picked, indices = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        if target is not None:
            if target.shape != indices.shape:
                raise ValueError(
                    f"replayed routing of layer {self.layer} is {list(target.shape)} but the "
                    f"router sees {list(indices.shape)} (rows x top_k)"
                )
            indices = torch.where(target[:, :1] >= 0, target, indices)
            picked = scores.gather(1, indices)
        if not again:
            self.used = indices.detach()
        return picked, indices


class Routing:
    """The replayers of an engine's model chunks, and the row geometry that maps a batch's
    ``routed_experts`` to the rows each router sees (see the module docstring)."""

    def __init__(self, chunks: list[Any], tcfg: Any, ps: Any) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.per_chunk: list[list[Replayer]] = []
        for chunk in chunks:
            replayers = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = Replayer(module.layer_number - 1)
                    replayers.append(module.router_replay)
            self.per_chunk.append(replayers)
        self.layers = int(tcfg.num_layers)
        self.experts = int(tcfg.num_moe_experts or 0)
        self.top_k = int(tcfg.moe_router_topk) if self.experts else 0  # 0: dense
        self.pipeline = int(tcfg.pipeline_model_parallel_size)
        self.sp = ps.get_tensor_model_parallel_world_size() if tcfg.sequence_parallel else 1
        self.tp_rank, self.tp_group = ps.get_tensor_model_parallel_rank(), None
        if self.sp > 1:
            self.tp_group = ps.get_tensor_model_parallel_group()
        self.cp = ps.get_context_parallel_world_size()
        self.cp_rank = ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None

    @property
    def _replayers(self) -> list[Replayer]:
        return [r for replayers in self.per_chunk for r in replayers]

    def check(self, batch: Batch, spec: OutputSpec) -> None:
        """Refuse, in one line, what this model or layout cannot replay or report."""
        replay = ROUTED_EXPERTS in batch
        if not (replay or spec.routed_experts):
            return
        if not self.top_k:
            raise ConfigError(
                "routed_experts (routing replay) needs a mixture-of-experts model; this one "
                "has no router"
            )
        if spec.routed_experts and self.pipeline > 1:
            raise ConfigError("routed_experts output under pipeline parallel is not supported yet")
        if not replay:
            return
        column = batch[ROUTED_EXPERTS]
        if tuple(column.shape[-2:]) != (self.layers, self.top_k):
            raise ConfigError(
                f"routed_experts holds {tuple(column.shape[-2:])} (layers, top_k) per token but "
                f"the model routes over {self.layers} layers x top-{self.top_k}"
            )
        # a row is replayed whole or not at all (-1 first): a stray index would crash a gather
        recorded = column[..., :1] >= 0
        if column.numel() and (
            bool((recorded & (column < 0)).any()) or int(column.max()) >= self.experts
        ):
            raise ConfigError(
                f"routed_experts rows must hold {self.top_k} experts in [0, {self.experts}) "
                f"or start with {NOT_RECORDED} (not recorded)"
            )

    # ---- one schedule ---------------------------------------------------------------------
    def start(self, *, recompute: bool) -> None:
        """Before a schedule: ``recompute`` when its backward recomputes activations."""
        for replayer in self._replayers:
            replayer.recompute, replayer.target, replayer.used = recompute, None, None
            replayer.pending.clear()

    def finish(self) -> None:
        """After a schedule: drop its targets and recorded experts."""
        self.start(recompute=False)

    def before_forward(self, chunk: int, micro: Batch | None, row: Any) -> None:
        """Aim chunk ``chunk``'s routers at ``micro``'s replayed experts (None: their own)."""
        replayers = self.per_chunk[chunk]
        if not replayers:
            return
        targets = None
        if micro is not None and ROUTED_EXPERTS in micro:
            column = flat_column(micro, ROUTED_EXPERTS)
            held, length, real = self._geometry(row)
            if column.shape[0] != real.numel():
                raise ValueError(
                    f"routed_experts holds {column.shape[0]} tokens but the micro-batch "
                    f"{real.numel()}"
                )
            device = row.input_ids.device
            full = torch.full(
                (length, *column.shape[1:]), NOT_RECORDED, dtype=torch.long, device=device
            )
            full[real.to(device)] = column.to(device, torch.long)
            targets = full[held.to(device)]
        for replayer in replayers:
            replayer.target = None if targets is None else targets[:, replayer.layer]

    def used(self, row: Any) -> torch.Tensor:
        """``[real tokens, layers, top_k]`` int16: the experts the last forward used for each
        token of ``row``, from every tensor- and context-parallel rank (all of them call this
        together; one pipeline stage holds every layer, see :meth:`check`)."""
        held, length, real = self._geometry(row)
        device = row.input_ids.device
        # int32: neither gloo nor NCCL reduce int16; -1 everywhere another rank holds the row
        full = torch.full((length, self.layers, self.top_k), -1, dtype=torch.int32, device=device)
        for replayer in self._replayers:
            if replayer.used is None:
                raise RuntimeError(f"router {replayer.layer} has not run on this micro-batch")
            full[held.to(device), replayer.layer] = replayer.used.to(torch.int32)
        for group in (self.tp_group, self.cp_group):
            if group is not None:
                dist.all_reduce(full, op=dist.ReduceOp.MAX, group=group)
        return full[real.to(device)].to(torch.int16)

    def _geometry(self, row: Any) -> tuple[torch.Tensor, int, torch.Tensor]:
        """``(row positions this rank's routers see, in their order; the whole row's length;
        positions of the real tokens in it)``, on the host."""
        if isinstance(row, ContextParallelRow):
            padded = list(row.padded)
            held = chunk_index(padded, self.cp, self.cp_rank)
            length, real = sum(padded), real_positions(list(row.lengths), padded)
        else:
            length = int(row.input_ids.shape[1])
            held, real = torch.arange(length), torch.arange(row.num_tokens)
        if self.sp > 1:  # sequence parallel: a contiguous share per tensor-parallel rank
            held = held.chunk(self.sp)[self.tp_rank]
        return held, length, real
