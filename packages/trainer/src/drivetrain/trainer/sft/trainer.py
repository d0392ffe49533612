"""The SFT job: the controller side of a step, driving a worker group (the run loop around it
is :mod:`drivetrain.trainer.run_loop`'s).

The same code runs in-process, on every torchrun rank (SPMD; only rank 0 writes files) and as
the single controller of Ray actors. Data order depends only on (seed, step), so resuming from
a checkpoint replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from drivetrain.trainer.data.batching import StepPlan, eval_batches, make_batch
from drivetrain.trainer.run_loop import Job, Outcome, supervised_spec
from drivetrain.trainer.sft.config import SFTConfig
from drivetrain.trainer.sft.dataset import SFTData
from drivetrain.trainer.workers.engine_worker import EngineWorker, StepStats
from drivetrain.trainer.workers.group import WorkerGroup


def total_steps(config: SFTConfig, plan: StepPlan) -> int:
    return config.run.max_steps or config.run.epochs * plan.steps_per_epoch


@dataclass
class SFTResult:
    output_dir: Path
    final_step: int
    train_loss: dict[int, float] = field(default_factory=dict)  # 1-based step -> loss
    val_loss: float | None = None
    hf_dir: Path | None = None


class SFTTrainer(Job[SFTResult]):
    def __init__(
        self,
        config: SFTConfig,
        *,
        engine_name: str,
        group: WorkerGroup,
        data: SFTData,
        pad_token_id: int,
    ) -> None:
        self.config = config
        self.group = group
        self.data = data
        self.pad_token_id = pad_token_id
        self.plan = StepPlan(
            len(data.train), config.run.batch_size, config.seed, config.data.shuffle
        )
        total = total_steps(config, self.plan)
        identity = {"engine": engine_name, "model_path": config.engine.model.path}
        state = {**identity, "seed": config.seed, "batch_size": config.run.batch_size}
        self.spec = supervised_spec(
            "sft", total, config, group, identity=identity, state={**state, "total_steps": total}
        )

    # ---- steps --------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[StepStats, int]:
        examples = [self.data.train[i] for i in self.plan.indices(step)]
        batch = make_batch(
            examples, pad_token_id=self.pad_token_id, packed=self.config.data.packing, step=step
        )
        return self.group.run_sharded(EngineWorker.train_step, batch, "sft"), batch.num_tokens

    def run_step(self, step: int) -> dict[str, float]:
        began = time.perf_counter()
        stats, tokens = self.train_step(step)
        elapsed = time.perf_counter() - began
        epoch = step / self.plan.steps_per_epoch
        return stats.train_metrics(
            step, tokens_per_s=tokens / elapsed, epoch=epoch, loss_tokens=True
        )

    def validate(self) -> dict[str, float]:
        """The token-mean NLL of the validation examples (``val/loss``)."""
        if not self.data.val:
            return {}
        nll, tokens = 0.0, 0
        for chunk in eval_batches(self.data.val, self.config.run.eval_batch_size):
            batch = make_batch(
                chunk, pad_token_id=self.pad_token_id, packed=self.config.data.packing
            )
            chunk_nll, chunk_tokens = self.group.run_sharded(EngineWorker.eval_nll, batch)
            nll, tokens = nll + chunk_nll, tokens + chunk_tokens
        return {"val/loss": nll / max(tokens, 1)}

    def result(self, outcome: Outcome) -> SFTResult:
        return SFTResult(
            outcome.output_dir,
            outcome.final_step,
            outcome.headlines,
            val_loss=outcome.val_after.get("val/loss"),
            hf_dir=outcome.hf_dir,
        )
