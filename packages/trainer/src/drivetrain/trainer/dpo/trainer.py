"""The preference loop: each step's pairs (chosen and rejected packed together), the reference
log-probs on the ranks that hold them, one optimizer step; held-out pairs scored before and
after (and every ``eval_every`` steps).

Data order depends only on (seed, step), as SFT's, so a resumed run replays the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from drivetrain.trainer.checkpoints import Checkpoint, CheckpointManager
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.data.batching import StepPlan, eval_batches
from drivetrain.trainer.dpo.config import DPOConfig
from drivetrain.trainer.dpo.data import Pair, pair_batch
from drivetrain.trainer.dpo.loss import PreferenceLoss
from drivetrain.trainer.dpo.worker import PreferenceWorker
from drivetrain.trainer.metrics import METRICS_FILE, MetricsLogger, plot_loss_curve
from drivetrain.trainer.progress import TrainingProgress
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.run_dir import adopt_checkpoint, check_steps_left, steps_knob
from drivetrain.trainer.stopping import Position, run_signals, stop_here
from drivetrain.trainer.workers.group import WorkerGroup, launched_by_torchrun
from drivetrain.trainer.workers.role_worker import ACTOR


@dataclass(frozen=True)
class PreferenceData:
    train: tuple[Pair, ...]
    val: tuple[Pair, ...]
    pad_token_id: int


@dataclass
class DPOResult:
    output_dir: Path
    final_step: int
    train_loss: dict[int, float] = field(default_factory=dict)  # 1-based step -> loss
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    hf_dir: Path | None = None
    seconds: float = 0.0


def total_steps(config: DPOConfig, plan: StepPlan) -> int:
    return config.run.max_steps or config.run.epochs * plan.steps_per_epoch


class DPOTrainer:
    def __init__(
        self,
        config: DPOConfig,
        *,
        engine_name: str,
        group: WorkerGroup,
        data: PreferenceData,
        console: Console | None = None,
    ) -> None:
        self.config, self.engine_name, self.group, self.data = config, engine_name, group, data
        self.console = console or plain_console()
        a = config.algorithm
        self.loss = PreferenceLoss(a.loss, a.beta, a.simpo_gamma)
        self.reference = Reference(config.reference_mode)
        self.plan = StepPlan(
            len(data.train), config.run.batch_size, config.seed, config.data.shuffle
        )
        self.total = total_steps(config, self.plan)
        self.out = Path(config.run.output_dir)
        self.checkpoints = CheckpointManager(
            self.out / "checkpoints", keep_last=config.run.keep_last, writer=group.is_writer
        )
        self.position = Position(self.checkpoints)  # where the run is (for a stop)

    def state(self) -> dict[str, Any]:
        """What identifies the run in its checkpoints (a resume must match it)."""
        c = self.config
        return {
            "command": "dpo",
            "engine": self.engine_name,
            "model_path": c.engine.model.path,
            "loss": c.algorithm.loss,
            "reference": self.reference.mode,
            "seed": c.seed,
            "batch_size": c.run.batch_size,
            "total_steps": self.total,
        }

    def batch(self, pairs: Sequence[Pair], step: int | None = None) -> Any:
        return pair_batch(
            pairs, pad_token_id=self.data.pad_token_id, packed=self.config.data.packing, step=step
        )

    def step_metrics(self, step: int) -> dict[str, float]:
        began = time.perf_counter()
        pairs = [self.data.train[i] for i in self.plan.indices(step)]
        batch = self.batch(pairs, step)
        stats = self.group.run_sharded(
            PreferenceWorker.train_pairs, batch, self.loss, self.reference
        )
        elapsed = time.perf_counter() - began
        if not math.isfinite(stats.loss):
            raise FloatingPointError(f"loss is {stats.loss} at step {step + 1}")
        metrics = {
            "train/loss": stats.loss,
            "train/grad_norm": stats.grad_norm,
            "train/lr": stats.lr,
            "train/tokens_per_s": batch.num_tokens / elapsed,
            "train/epoch": step / self.plan.steps_per_epoch,
            **{f"train/{k}": v for k, v in stats.metrics.items()},
        }
        every, done = self.config.run.eval_every, step + 1
        if every and done % every == 0 and done < self.total:
            metrics.update(self.validate())
        return metrics

    def validate(self) -> dict[str, float]:
        """Held-out pairs: the loss and each logged quantity's mean (``val/...``)."""
        if not self.data.val:
            return {}
        sums: dict[str, float] = {}
        for chunk in eval_batches(self.data.val, self.config.run.eval_batch_size):
            got = self.group.run_sharded(
                PreferenceWorker.eval_pairs, self.batch(chunk), self.loss, self.reference
            )
            for name, value in got.items():
                sums[name] = sums.get(name, 0.0) + value
        pairs = max(sums.pop("pairs", 0.0), 1.0)
        return {f"val/{name}": value / pairs for name, value in sums.items()}

    def save(self, step: int) -> None:
        with self.checkpoints.writing(step):
            path = self.checkpoints.engine_staging_path(step)
            self.group.run_all(PreferenceWorker.save_checkpoint, path, step, (ACTOR,))
            self.checkpoints.publish(step, {**self.state(), "time": time.time()})
        self.position.saved = step

    def fit(self, *, start_from: Checkpoint | None = None) -> DPOResult:
        began = time.perf_counter()
        start = 0
        if start_from is not None:
            adopt_checkpoint(start_from, self.state(), self.checkpoints)
            check_steps_left(start_from, self.total, steps_knob(self.config.run))
            start = self.group.run_all(
                PreferenceWorker.load_checkpoint, start_from.engine_path, (ACTOR,)
            )
            self.console.print(f"resumed from {start_from.path} at step {start}")
        result = DPOResult(self.out, final_step=start)
        self.position = Position(self.checkpoints, start, start if start_from else None)
        result.val_before = self.validate()
        if result.val_before:
            self.console.print(f"held-out pairs before: {_fmt(result.val_before)}")
        writer = self.group.is_writer
        logger = (
            MetricsLogger(self.out, self.config.logging, run_config=self.state(), resume_step=start)
            if writer
            else None
        )
        try:
            with TrainingProgress(
                self.total, start, enabled=self.config.logging.progress and writer,
                console=self.console, description="dpo",
            ) as progress, run_signals(
                self.config.run, self.position, agree=launched_by_torchrun()
            ) as stop:  # fmt: skip
                for step in range(start, self.total):
                    if stop.requested():
                        raise stop_here(stop, self.position, self.save)
                    metrics = self.step_metrics(step)
                    done = self.position.done = step + 1
                    result.train_loss[done], result.final_step = metrics["train/loss"], done
                    if logger is not None:
                        logger.log(done, metrics)
                    progress.update(
                        loss=metrics["train/loss"], tokens_per_s=metrics["train/tokens_per_s"]
                    )
                    save_every = self.config.run.save_every
                    if save_every and done % save_every == 0 and done < self.total:
                        self.save(done)
            self.save(self.total)
            result.val_after = self.validate()
            if result.val_after:
                self.console.print(f"held-out pairs after: {_fmt(result.val_after)}")
                if logger is not None:
                    logger.log(self.total, result.val_after)
            if self.config.run.export_hf:
                result.hf_dir = self.out / "hf"
                self.group.run_all(PreferenceWorker.export_hf, str(result.hf_dir))
        finally:
            if logger is not None:
                logger.close()
        if writer:
            plot_loss_curve(self.out / METRICS_FILE, self.out / "loss_curve.png")
        result.seconds = time.perf_counter() - began
        return result


def _fmt(metrics: dict[str, float]) -> str:
    keys = ("val/loss", "val/preference_accuracy", "val/rewards/accuracies", "val/rewards/margins")
    return ", ".join(f"{k.removeprefix('val/')} {metrics[k]:.3f}" for k in keys if k in metrics)
