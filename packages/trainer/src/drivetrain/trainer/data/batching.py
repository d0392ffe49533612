"""Which examples make up each optimizer step, and the Batch the engine receives.

The order is a pure function of (seed, epoch), so a resumed run that knows its step number
replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from drivetrain.api import Batch, BatchMeta
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK
from drivetrain.trainer.column_contract import check_columns
from drivetrain.trainer.data.tokenize import Example


@dataclass(frozen=True)
class StepPlan:
    """Global batches of ``batch_size`` examples; an epoch's incomplete tail is dropped."""

    num_examples: int
    batch_size: int
    seed: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"batch size {self.batch_size} is larger than the {self.num_examples} "
                "training examples"
            )

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.batch_size

    def epoch_order(self, epoch: int) -> list[int]:
        order = list(range(self.num_examples))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def indices(self, step: int) -> list[int]:
        """Example indices of 0-based optimizer step ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.batch_size
        return self.epoch_order(epoch)[start : start + self.batch_size]


def make_batch(
    examples: Sequence[Example], *, pad_token_id: int, packed: bool, step: int | None = None
) -> Batch:
    """Right-padded ``input_ids``/``loss_mask`` columns, or the packed layout."""
    width = max(len(e) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.float32)
    for row, example in enumerate(examples):
        ids[row, : len(example)] = torch.tensor(example.input_ids)
        mask[row, : len(example)] = torch.tensor(example.loss_mask, dtype=torch.float32)
    batch = Batch.from_columns(
        {INPUT_IDS: ids, LOSS_MASK: mask},
        seq_lens=[len(e) for e in examples],
        meta=BatchMeta(pad_token_id=pad_token_id, step=step),
    )
    return check_columns(batch.to_packed() if packed else batch)


def eval_batches(examples: Sequence[Example], size: int) -> list[Sequence[Example]]:
    return [examples[i : i + size] for i in range(0, len(examples), size)]
