"""The preference loop: each step's pairs (chosen and rejected packed together), the reference
log-probs on the ranks that hold them, one optimizer step; held-out pairs scored before and
after (and every ``eval_every`` steps).

Data order depends only on (seed, step), as SFT's, so a resumed run replays the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drivetrain.trainer.data.batching import StepPlan, eval_batches
from drivetrain.trainer.dpo.config import DPOConfig
from drivetrain.trainer.dpo.data import Pair, pair_batch
from drivetrain.trainer.dpo.loss import PreferenceLoss
from drivetrain.trainer.dpo.worker import PreferenceWorker
from drivetrain.trainer.reference import Reference
from drivetrain.trainer.run_loop import Job, Outcome, supervised_spec
from drivetrain.trainer.workers.group import WorkerGroup


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


class DPOTrainer(Job[DPOResult]):
    def __init__(
        self, config: DPOConfig, *, engine_name: str, group: WorkerGroup, data: PreferenceData
    ) -> None:
        self.config, self.group, self.data = config, group, data
        a = config.algorithm
        self.loss = PreferenceLoss(a.loss, a.beta, a.simpo_gamma)
        self.reference = Reference(config.reference_mode)
        self.plan = StepPlan(
            len(data.train), config.run.batch_size, config.seed, config.data.shuffle
        )
        total = total_steps(config, self.plan)
        state = {  # what identifies the run in its checkpoints (a resume must match it)
            "command": "dpo",
            "engine": engine_name,
            "model_path": config.engine.model.path,
            "loss": a.loss,
            "reference": self.reference.mode,
            "seed": config.seed,
            "batch_size": config.run.batch_size,
            "total_steps": total,
        }
        self.spec = supervised_spec(
            "dpo",
            total,
            config,
            group,
            state=state,
            identity=state,
            validate_before=True,
            validation_label="held-out pairs",
        )

    def batch(self, pairs: Sequence[Pair], step: int | None = None) -> Any:
        return pair_batch(
            pairs, pad_token_id=self.data.pad_token_id, packed=self.config.data.packing, step=step
        )

    def run_step(self, step: int) -> dict[str, float]:
        began = time.perf_counter()
        pairs = [self.data.train[i] for i in self.plan.indices(step)]
        batch = self.batch(pairs, step)
        stats = self.group.run_sharded(
            PreferenceWorker.train_pairs, batch, self.loss, self.reference
        )
        elapsed = time.perf_counter() - began
        epoch = step / self.plan.steps_per_epoch
        return stats.train_metrics(step, tokens_per_s=batch.num_tokens / elapsed, epoch=epoch)

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

    def describe(self, metrics: Mapping[str, float]) -> str:
        keys = (
            "val/loss",
            "val/preference_accuracy",
            "val/rewards/accuracies",
            "val/rewards/margins",
        )
        return ", ".join(f"{k.removeprefix('val/')} {metrics[k]:.3f}" for k in keys if k in metrics)

    def result(self, outcome: Outcome) -> DPOResult:
        return DPOResult(
            outcome.output_dir,
            outcome.final_step,
            outcome.headlines,
            outcome.val_before,
            outcome.val_after,
            outcome.hf_dir,
            outcome.seconds,
        )
