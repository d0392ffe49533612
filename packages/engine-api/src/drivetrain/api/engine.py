"""The training-engine contract.

An engine owns one model replica's shard on one process (rank): its parameters, optimizer,
LR schedule, parallel layout and micro-batching. The trainer drives it through this interface
only, in-process, under ``torchrun`` or inside a Ray actor; every method is called on *every*
rank of the engine's process group in the same order (SPMD), because most of them run
collectives.

Distributed set-up follows torchrun's convention: ``initialize()`` joins the process group
described by ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` if
none exists yet, so the same engine runs under torchrun, Ray (the worker sets those variables)
or alone (no variables: a world of one).

A typical step::

    with engine.train_mode():
        engine.optimizer_zero_grad()
        result = engine.forward_backward(batch, loss_fn, outputs=OutputSpec(log_probs=True))
        grad_norm = engine.optimizer_step()
        lr = engine.lr_scheduler_step()
    with engine.eval_mode():
        scored = engine.infer(batch, OutputSpec(log_probs=True, entropy=True))
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api.batch import Batch
from drivetrain.api.config import EngineConfig
from drivetrain.api.loss import LossFn, OutputSpec

#: One exported weight: its Hugging Face parameter name and the full (unsharded) tensor.
NamedTensor = tuple[str, Any]


@dataclass(frozen=True)
class ParallelInfo:
    """Where this rank sits, so the controller can dispatch data and collect results.

    Data is split by ``dp_rank``/``dp_size``: all ranks with the same ``dp_rank`` (tensor,
    pipeline, context or sequence parallel peers) receive the same data. Only ranks with
    ``is_output_rank`` return results (e.g. the last pipeline stage's first tensor-parallel
    rank); the controller collects from those, one per ``dp_rank``.
    """

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    is_output_rank: bool = True
    sizes: Mapping[str, int] = field(default_factory=dict)  # e.g. {"tp": 2, "pp": 1, "sp": 1}

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if not 0 <= self.dp_rank < self.dp_size or self.world_size % self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank}/dp_size {self.dp_size} invalid")

    def shard_of(self, batch: Batch) -> Batch:
        """This rank's share of a global batch: ``batch.dp_shards(dp_size)[dp_rank]``
        (token-balanced, sample groups kept whole, in the global batch's order), the same for
        every rank with this ``dp_rank``. The controller shards this way and nothing else
        (an engine receives its shard and cannot choose another split), so results collected
        per ``dp_rank`` join back with :func:`~drivetrain.api.batch.restore_order`. Shards
        may hold different numbers of samples and micro-batches: engines agree on a common
        micro-batch count (running empty ones where needed) so their collectives line up."""
        return batch.select(batch.dp_shards(self.dp_size)[self.dp_rank])


@dataclass(frozen=True)
class StepResult:
    """What ``forward_backward`` reports, identical on every rank.

    ``loss`` is the mini-batch loss: the sum of every micro-batch's returned loss over all
    data-parallel ranks (for a token-mean loss: the global token mean). ``metrics`` are summed
    the same way, except ``*_max`` ones, reduced by max (:func:`drivetrain.api.merge_metrics`).
    """

    loss: float
    metrics: Mapping[str, float]
    num_micro_batches: int
    num_tokens: int  # loss tokens of the mini-batch on all data-parallel ranks


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    step: int


class Engine(abc.ABC):
    """Base class of every training engine. See the module docstring for the calling model."""

    config: EngineConfig

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    # ---- life cycle ---------------------------------------------------------------------
    @abc.abstractmethod
    def initialize(self) -> None:
        """Join the process group, build (or load) the model, optimizer and LR scheduler.

        Must be called once, on every rank, before anything else except ``parallel``.
        Afterwards the engine is in neither mode; with offload enabled its state is on host.
        """

    @property
    @abc.abstractmethod
    def parallel(self) -> ParallelInfo:
        """This rank's place in the data-parallel and model-parallel layout."""

    # ---- modes --------------------------------------------------------------------------
    @abc.abstractmethod
    def train_mode(self) -> AbstractContextManager[None]:
        """Context in which ``forward_backward``/optimizer/scheduler calls are allowed.

        On entry: parameters (and optimizer state) on the device, model in training mode
        (dropout on). On exit: whatever the offload config says goes back to host memory.
        Calling a training method outside it raises :class:`EngineStateError`.
        """

    @abc.abstractmethod
    def eval_mode(self) -> AbstractContextManager[None]:
        """Context for ``infer``: parameters on the device, dropout off, no gradients kept.
        Optimizer state may stay offloaded. On exit: offload as configured."""

    # ---- compute ------------------------------------------------------------------------
    @abc.abstractmethod
    def forward_backward(
        self, batch: Batch, loss_fn: LossFn, *, outputs: OutputSpec | None = None
    ) -> StepResult:
        """Run forward and backward over this rank's mini-batch, accumulating gradients.

        The engine cuts ``batch`` into micro-batches per ``config.micro_batch`` (fixed size or
        token budget; distributed engines make every rank run the same number), computes
        ``outputs`` (default: log-probs at temperature 1) for each, calls ``loss_fn`` with a
        :class:`LossContext` whose counts cover the mini-batch on all data-parallel ranks, and
        back-propagates so that the accumulated gradient equals the gradient of the *sum* of
        the returned losses over micro-batches and ranks, whatever the micro-batch split and
        whatever the engine's data-parallel gradient reduction (mean or sum). Gradients are
        not zeroed here: call ``optimizer_zero_grad()`` first.
        """

    @abc.abstractmethod
    def infer(self, batch: Batch, outputs: OutputSpec) -> Batch | None:
        """Per-token outputs without gradients (log-probs, entropy, values).

        Returns, on output ranks, a batch with the same samples in the same order as ``batch``,
        in the same layout, holding the requested columns (token columns aligned with
        ``input_ids``) and no others; ``None`` on other ranks. Micro-batching is the engine's.
        """

    def trace_ops(self, batch: Batch) -> Mapping[str, Any] | None:
        """Optional (``drivetrain diagnose mismatch``): for a batch of one sequence, in eval
        mode, each op's output (the model's modules by their Hugging Face names, in the order
        they first ran) at every position, ``[positions, ...]`` host tensors, and the
        ``log_probs`` ``infer`` gives. ``None``, the default: this engine cannot tell."""
        return None

    @abc.abstractmethod
    def optimizer_zero_grad(self) -> None:
        """Clear accumulated gradients."""

    @abc.abstractmethod
    def optimizer_step(self) -> float:
        """Clip gradients to ``config.optim.clip_grad`` and step the optimizer.

        Returns the total gradient norm before clipping, the same on every rank. If it is not
        finite the update is skipped (parameters unchanged) and the norm is still returned.
        """

    @abc.abstractmethod
    def lr_scheduler_step(self) -> float:
        """Advance the LR schedule by one step; return the learning rate now in effect."""

    # ---- placement ----------------------------------------------------------------------
    @abc.abstractmethod
    def to(self, device: str, *, model: bool = True, optimizer: bool = True) -> None:
        """Move parameters and/or optimizer state to host memory (``"cpu"``) or back to the
        engine's compute device (``"device"``)."""

    def close(self) -> None:
        """Free device memory and process-group resources the engine created; idempotent."""
        return None

    # ---- weights and checkpoints --------------------------------------------------------
    @abc.abstractmethod
    def export_weights(self, *, adapter_only: bool = False) -> Iterator[NamedTensor]:
        """Stream the model's weights as Hugging Face named, full (unsharded) tensors.

        Every rank must call it and consume the iterator to the end (it may run collectives);
        every rank yields the same names in the same order, each exactly once. At most a bounded
        number of full tensors (about one layer) is materialised at a time, never the whole
        state dict. With LoRA: merged weights by default, adapter weights (peft names) if
        ``adapter_only``. Tensors must not be modified by the consumer.
        """

    def adapter_config(self) -> Mapping[str, Any] | None:
        """The peft adapter config (as a dict) when LoRA is on, else ``None``."""
        return None

    def disable_adapter(self) -> AbstractContextManager[None]:
        """Context in which the model runs without its LoRA adapter (the reference policy).

        Engines without LoRA raise :class:`EngineStateError`."""
        from drivetrain.api.errors import EngineStateError

        raise EngineStateError(f"{type(self).__name__} has no LoRA adapter to disable")

    @abc.abstractmethod
    def save_checkpoint(self, path: str, *, step: int) -> CheckpointInfo:
        """Save model, optimizer, LR scheduler, RNG states and ``step`` under ``path``.

        Atomic: ``path`` either holds a complete checkpoint or does not exist, even if the
        process dies mid-write. Collective: every rank calls it.
        """

    @abc.abstractmethod
    def load_checkpoint(self, path: str) -> CheckpointInfo:
        """Restore everything ``save_checkpoint`` wrote; the next step continues exactly.

        Engines that support it load checkpoints written at another world size/layout."""
