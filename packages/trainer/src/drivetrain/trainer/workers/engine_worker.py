"""One rank of a worker group: an engine found through the registry, and the operations the
trainer's roles run on it.

The same class runs in this process, in every torchrun process and inside each Ray actor. Every
method is called on every rank in the same order (the engine's SPMD contract) and returns the
same value on every rank, so a controller can read any one of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from drivetrain.api import Batch, EngineConfig, LossFn, OutputSpec, ParallelInfo, registry
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK
from drivetrain.trainer.hf_export import write_hf_model
from drivetrain.trainer.named_losses import get_loss


@dataclass(frozen=True)
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    metrics: Mapping[str, float] = field(default_factory=dict)

    def train_metrics(
        self, step: int, *, tokens_per_s: float, epoch: float, loss_tokens: bool = False
    ) -> dict[str, float]:
        """A supervised (SFT, DPO) step's ``train/...`` metrics, the loss's own last (and
        ``train/loss_tokens`` before them when asked); a non-finite loss is an error here."""
        if not math.isfinite(self.loss):
            raise FloatingPointError(f"loss is {self.loss} at step {step + 1}")
        counted = {"train/loss_tokens": self.num_tokens} if loss_tokens else {}
        return {
            "train/loss": self.loss,
            "train/grad_norm": self.grad_norm,
            "train/lr": self.lr,
            **counted,
            "train/tokens_per_s": tokens_per_s,
            "train/epoch": epoch,
            **{f"train/{k}": v for k, v in self.metrics.items()},
        }


class EngineWorker:
    def __init__(self, engine_name: str, config: EngineConfig) -> None:
        factory = registry.engines.load(engine_name)
        self.engine = factory(config)
        self.config = config

    def initialize(self) -> ParallelInfo:
        self.engine.initialize()
        return self.engine.parallel

    def shard(self, batch: Batch) -> Batch:
        return self.engine.parallel.shard_of(batch)

    def train_step(self, shard: Batch, loss: str | LossFn) -> StepStats:
        """One optimizer step. ``loss``: a name in :mod:`drivetrain.trainer.named_losses`, or a loss
        object (picklable, for Ray) whose ``outputs`` attribute says what it needs."""
        engine = self.engine
        loss_fn = get_loss(loss) if isinstance(loss, str) else loss
        outputs = getattr(loss_fn, "outputs", OutputSpec())
        with engine.train_mode():
            engine.optimizer_zero_grad()
            result = engine.forward_backward(shard, loss_fn, outputs=outputs)
            grad_norm = engine.optimizer_step()
            lr = engine.lr_scheduler_step()
        return StepStats(
            loss=result.loss,
            grad_norm=grad_norm,
            lr=lr,
            num_tokens=result.num_tokens,
            metrics=dict(result.metrics),
        )

    def eval_nll(self, shard: Batch) -> tuple[float, int]:
        """Summed NLL and loss-token count over the whole batch (all data-parallel ranks)."""
        import torch
        import torch.distributed as dist

        with self.engine.eval_mode():
            scored = self.engine.infer(shard, OutputSpec(log_probs=True))
        local = (0.0, 0)
        if scored is not None:
            mask = shard[LOSS_MASK].to(torch.float64)
            nll = -(scored[LOG_PROBS].to(torch.float64) * mask).sum()
            local = (float(nll), int(mask.sum()))
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return local
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        return sum(g[0] for g in gathered), sum(g[1] for g in gathered)

    def save_checkpoint(self, path: str, step: int) -> None:
        self.engine.save_checkpoint(path, step=step)

    def load_checkpoint(self, path: str) -> int:
        return self.engine.load_checkpoint(path).step

    def export_hf(self, path: str) -> None:
        """Hugging Face model directory from the engine's weight stream (rank 0 writes)."""
        import torch.distributed as dist

        writer = not dist.is_initialized() or dist.get_rank() == 0
        write_hf_model(
            path,
            self.engine.export_weights(),
            source_dir=self.config.model.path,
            adapter_config=self.engine.adapter_config(),
            writer=writer,
        )

    def close(self) -> None:
        self.engine.close()
