"""Controller-side tensors of one RL step: the rollout's completions as a padded batch, the
roles' per-token outputs put back in order, and rewards placed on the last response token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from drivetrain.api import Batch, Completion
from drivetrain.api.batch import restore_order
from drivetrain.api.columns import INPUT_IDS, LOSS_MASK, ROLLOUT_LOG_PROBS, SHARED_PREFIX_LEN
from drivetrain.api.partition import dp_shard_indices
from drivetrain.api.rollout_batch import PROMPT_INDEX, PROMPT_LENGTH, completions_to_batch
from drivetrain.trainer.workers.group import WorkerGroup

#: What the engines get: token ids, the loss mask, the prompt length as a prefix-sharing hint
#: (the n samples of a prompt may compute it once), and the RL columns added per step.
ENGINE_COLUMNS = (INPUT_IDS, LOSS_MASK, SHARED_PREFIX_LEN)


def completions_batch(completions: Sequence[Completion], pad_token_id: int) -> Batch:
    batch = completions_to_batch(completions, pad_token_id=pad_token_id, as_tensor=torch.tensor)
    return batch.with_columns(
        rollout_log_probs=batch[ROLLOUT_LOG_PROBS].to(torch.float32),
        loss_mask=batch[LOSS_MASK].to(torch.long),
        **{SHARED_PREFIX_LEN: torch.as_tensor(batch[PROMPT_LENGTH], dtype=torch.long)},
    )


def engine_view(batch: Batch, *extra: str) -> Batch:
    """Only the columns engines read (lists of strings and ids stay on the controller)."""
    keep = set(ENGINE_COLUMNS) | set(extra)
    return batch.drop(*[name for name in batch.columns if name not in keep])


def gather_outputs(group: WorkerGroup, batch: Batch, *args: Any) -> dict[str, torch.Tensor]:
    """``infer`` on every data-parallel shard; per-token outputs in the batch's order."""
    shards = dp_shard_indices(batch.seq_lens, group.parallel.dp_size)
    results = group.gather_sharded("infer", batch, *args)
    pieces = [
        Batch.from_columns(columns, seq_lens=batch.select(idx).seq_lens, token_keys=columns)
        for columns, idx in zip(results, shards, strict=True)
    ]
    whole = restore_order(pieces, shards)
    return {name: whole[name] for name in whole.columns}


def last_token_rewards(batch: Batch, scores: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` zeros with each sample's score on its last response token."""
    mask = batch[LOSS_MASK]
    rewards = torch.zeros(mask.shape, dtype=torch.float32)
    last = torch.as_tensor(batch.seq_lens) - 1
    rewards[torch.arange(len(batch)), last] = scores.to(torch.float32)
    return rewards


def group_ids(batch: Batch) -> list[int]:
    return [int(i) for i in batch[PROMPT_INDEX]]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    mask = mask.to(values.dtype)
    return float((values * mask).sum() / mask.sum().clamp(min=1))
