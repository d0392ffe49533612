"""The SFT loop: the controller side, driving a worker group step by step.

The same code runs in-process, on every torchrun rank (SPMD; only rank 0 writes files) and as
the single controller of Ray actors. Data order depends only on (seed, step), so resuming from
a checkpoint replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.trainer.checkpoints import Checkpoint, CheckpointManager
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.data.batching import StepPlan, eval_batches, make_batch
from drivetrain.trainer.errors import CheckpointError
from drivetrain.trainer.metrics import METRICS_FILE, MetricsLogger, plot_loss_curve
from drivetrain.trainer.progress import TrainingProgress
from drivetrain.trainer.run_dir import check_steps_left, steps_knob
from drivetrain.trainer.sft.config import SFTConfig
from drivetrain.trainer.sft.dataset import SFTData
from drivetrain.trainer.stopping import Position, run_signals, stop_here
from drivetrain.trainer.workers.engine_worker import EngineWorker, StepStats
from drivetrain.trainer.workers.group import WorkerGroup, launched_by_torchrun


def total_steps(config: SFTConfig, plan: StepPlan) -> int:
    return config.run.max_steps or config.run.epochs * plan.steps_per_epoch


@dataclass
class SFTResult:
    output_dir: Path
    final_step: int
    train_loss: dict[int, float] = field(default_factory=dict)  # 1-based step -> loss
    val_loss: float | None = None
    hf_dir: Path | None = None


class SFTTrainer:
    def __init__(
        self,
        config: SFTConfig,
        *,
        engine_name: str,
        group: WorkerGroup,
        data: SFTData,
        pad_token_id: int,
        console: Console | None = None,
    ) -> None:
        self.config = config
        self.engine_name = engine_name
        self.group = group
        self.data = data
        self.pad_token_id = pad_token_id
        self.console = console or plain_console()
        self.plan = StepPlan(
            len(data.train), config.run.batch_size, config.seed, config.data.shuffle
        )
        self.total = total_steps(config, self.plan)
        self.out = Path(config.run.output_dir)
        self.checkpoints = CheckpointManager(
            self.out / "checkpoints", keep_last=config.run.keep_last, writer=group.is_writer
        )
        self.position = Position(self.checkpoints)  # where the run is (for a stop)

    # ---- resume -------------------------------------------------------------------------
    def _check_resumable(self, found: Checkpoint) -> None:
        state = found.state
        if state.get("engine") != self.engine_name:
            raise CheckpointError(
                f"{found.path} was written by engine {state.get('engine')!r}, not "
                f"{self.engine_name!r}; use another run.output_dir or --overwrite"
            )
        if state.get("model_path") != self.config.engine.model.path:
            raise CheckpointError(
                f"{found.path} trained model {state.get('model_path')!r}, not "
                f"{self.config.engine.model.path!r}; use another run.output_dir or --overwrite"
            )
        self.checkpoints.run_id = found.run_id or self.checkpoints.run_id

    def _state(self) -> Mapping[str, Any]:
        return {
            "engine": self.engine_name,
            "model_path": self.config.engine.model.path,
            "seed": self.config.seed,
            "batch_size": self.config.run.batch_size,
            "total_steps": self.total,
            "time": time.time(),
        }

    # ---- steps --------------------------------------------------------------------------
    def train_step(self, step: int) -> tuple[StepStats, int]:
        examples = [self.data.train[i] for i in self.plan.indices(step)]
        batch = make_batch(
            examples, pad_token_id=self.pad_token_id, packed=self.config.data.packing, step=step
        )
        return self.group.run_sharded(EngineWorker.train_step, batch, "sft"), batch.num_tokens

    def step_metrics(self, step: int) -> dict[str, float]:
        """Train 0-based ``step``; its metrics, with the validation loss when one is due."""
        began = time.perf_counter()
        stats, tokens = self.train_step(step)
        elapsed = time.perf_counter() - began
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"loss is {stats.loss} at step {step + 1}")
        metrics = {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/loss_tokens": stats.num_tokens,
            "train/tokens_per_s": tokens / elapsed,
            "train/epoch": step / self.plan.steps_per_epoch,
            **{f"train/{k}": v for k, v in stats.metrics.items()},
        }
        every, done = self.config.run.eval_every, step + 1
        if every and done % every == 0 and done < self.total:
            val = self.validation_loss()
            if val is not None:
                metrics["val/loss"] = val
        return metrics

    def validation_loss(self) -> float | None:
        if not self.data.val:
            return None
        nll, tokens = 0.0, 0
        for chunk in eval_batches(self.data.val, self.config.run.eval_batch_size):
            batch = make_batch(
                chunk, pad_token_id=self.pad_token_id, packed=self.config.data.packing
            )
            chunk_nll, chunk_tokens = self.group.run_sharded(EngineWorker.eval_nll, batch)
            nll, tokens = nll + chunk_nll, tokens + chunk_tokens
        return nll / max(tokens, 1)

    def save(self, step: int) -> None:
        with self.checkpoints.writing(step):
            self.group.run_all(
                EngineWorker.save_checkpoint, self.checkpoints.engine_staging_path(step), step
            )
            self.checkpoints.publish(step, self._state())
        self.position.saved = step

    # ---- the loop -----------------------------------------------------------------------
    def fit(self, *, start_from: Checkpoint | None = None) -> SFTResult:
        """Train from ``start_from`` (a verified checkpoint: see :mod:`run_dir`) or step 0."""
        run = self.config.run
        start = 0
        if start_from is not None:
            self._check_resumable(start_from)
            check_steps_left(start_from, self.total, steps_knob(self.config.run))
            start = self.group.run_all(EngineWorker.load_checkpoint, start_from.engine_path)
            self.console.print(f"resumed from {start_from.path} at step {start}")
        result = SFTResult(self.out, final_step=start)
        self.position = Position(self.checkpoints, start, start if start_from else None)
        logger = (
            MetricsLogger(
                self.out, self.config.logging, run_config=self._state(), resume_step=start
            )
            if self.group.is_writer
            else None
        )
        try:
            with (
                TrainingProgress(
                    self.total,
                    start,
                    enabled=self.config.logging.progress and self.group.is_writer,
                    console=self.console,
                ) as progress,
                run_signals(run, self.position, agree=launched_by_torchrun()) as stop,
            ):
                for step in range(start, self.total):
                    if stop.requested():
                        raise stop_here(stop, self.position, self.save)
                    metrics = self.step_metrics(step)
                    done = step + 1
                    result.train_loss[done] = metrics["train/loss"]
                    result.final_step = self.position.done = done
                    if logger is not None:
                        logger.log(done, metrics)
                    progress.update(
                        loss=metrics["train/loss"], tokens_per_s=metrics["train/tokens_per_s"]
                    )
                    if run.save_every and done % run.save_every == 0 and done < self.total:
                        self.save(done)
            result.val_loss = self.validation_loss()
            if logger is not None and result.val_loss is not None:
                logger.log(self.total, {"val/loss": result.val_loss})
            self.save(self.total)
            if run.export_hf:
                result.hf_dir = self.out / "hf"
                self.group.run_all(EngineWorker.export_hf, str(result.hf_dir))
        finally:
            if logger is not None:
                logger.close()
        if self.group.is_writer:
            plot_loss_curve(self.out / METRICS_FILE, self.out / "loss_curve.png")
        return result
