"""Controller-side tensors of one RL step: the rollout's completions as a padded batch, the
roles' per-token outputs put back in order, and rewards placed on the last response token."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from drivetrain.api import Batch, Completion
from drivetrain.api.batch import restore_order
from drivetrain.api.columns import (
    INPUT_IDS,
    LOSS_MASK,
    ROLLOUT_LOG_PROBS,
    SHARED_PREFIX_LEN,
    TOKEN_WEIGHT_VERSION,
)
from drivetrain.trainer.column_contract import check_columns
from drivetrain.trainer.rl.group_stream import Taken
from drivetrain.trainer.rl.routing import with_routing
from drivetrain.trainer.rollout_batch import PROMPT_INDEX, PROMPT_LENGTH, completions_to_batch
from drivetrain.trainer.workers.group import WorkerGroup
from drivetrain.trainer.workers.role_worker import RoleWorker

#: What the engines get: token ids, the loss mask, the prompt length as a prefix-sharing hint
#: (the n samples of a prompt may compute it once), and the RL columns added per step.
ENGINE_COLUMNS = (INPUT_IDS, LOSS_MASK, SHARED_PREFIX_LEN)


def completions_batch(completions: Sequence[Completion], pad_token_id: int) -> Batch:
    batch = completions_to_batch(completions, pad_token_id=pad_token_id, as_tensor=torch.tensor)
    if any(c.routed_experts is not None for c in completions):
        batch = with_routing(batch, completions)
    return batch.with_columns(
        rollout_log_probs=batch[ROLLOUT_LOG_PROBS].to(torch.float32),
        loss_mask=batch[LOSS_MASK].to(torch.float32),
        **{SHARED_PREFIX_LEN: torch.as_tensor(batch[PROMPT_LENGTH], dtype=torch.long)},
    )


def engine_view(batch: Batch, *extra: str) -> Batch:
    """Only the columns engines read (lists of strings and ids stay on the controller)."""
    keep = set(ENGINE_COLUMNS) | set(extra)
    return check_columns(batch.drop(*[name for name in batch.columns if name not in keep]))


def gather_outputs(group: WorkerGroup, batch: Batch, *args: Any) -> dict[str, torch.Tensor]:
    """``infer`` on every data-parallel shard; per-token outputs in the batch's order."""
    shards = batch.dp_shards(group.parallel.dp_size)
    results = group.gather_sharded(RoleWorker.infer, batch, *args)
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


def taken_batch(taken: Taken, prompts: Sequence[Any]) -> tuple[list[Any], list[Completion]]:
    """A step's groups as the sync loop has them: its prompts, and their completions grouped
    by prompt with ``prompt_index`` the prompt's place in the step."""
    chosen = [prompts[g.prompt] for g in taken.groups]
    completions = [
        dataclasses.replace(c, prompt_index=i)
        for i, group in enumerate(taken.groups)
        for c in group.completions
    ]
    return chosen, completions


def stream_stats(taken: Taken) -> dict[str, float]:
    out = {
        "async/dropped_groups": float(taken.dropped),
        "async/ready_groups": float(taken.ready_left),
        "async/in_flight_groups": float(taken.in_flight),
        "async/dropped_samples": float(len(taken.dropped_lengths)),
    }
    if taken.dropped_lengths:  # against response/length_mean: are the long ones dropped?
        out["async/dropped_length_mean"] = sum(taken.dropped_lengths) / len(taken.dropped_lengths)
    return out


#: a token column of async batches: 1 where the token was sampled by the weights the step's
#: update starts from (numerics=exact makes their rollout log-probs the trainer's, bit for bit)
CURRENT_WEIGHTS = "current_weights"


def mark_current_weights(batch: Batch, trainer_version: int) -> Batch:
    """``batch`` with :data:`CURRENT_WEIGHTS`: which response tokens ``trainer_version``'s
    weights sampled."""
    current = (batch[TOKEN_WEIGHT_VERSION] == trainer_version) & batch[LOSS_MASK].bool()
    return batch.with_columns(token_keys=[CURRENT_WEIGHTS], current_weights=current.float())


def staleness_stats(batch: Batch, trainer_version: int) -> dict[str, float]:
    """How many versions each response token lags the trainer's weights: mean, max, the
    histogram (fraction of tokens per lag) and the fraction of samples spanning versions."""
    mask = batch[LOSS_MASK].bool()
    versions = batch[TOKEN_WEIGHT_VERSION]
    lag = (trainer_version - versions)[mask]
    if lag.numel() == 0:
        return {}
    out = {
        "async/staleness_mean": float(lag.float().mean()),
        "async/staleness_max": float(lag.max()),
    }
    values, counts = lag.unique(return_counts=True)
    for value, count in zip(values.tolist(), counts.tolist(), strict=True):
        out[f"async/staleness_frac/{value}"] = count / lag.numel()
    big = torch.where(mask, versions, torch.iinfo(versions.dtype).min).amax(-1)
    small = torch.where(mask, versions, torch.iinfo(versions.dtype).max).amin(-1)
    has = mask.any(-1)
    out["async/partial_samples_frac"] = float(((big > small) & has).float().mean())
    # mean response length by how far each sample's oldest token lags: long answers are the
    # ones that span versions and go stale, so a length bias shows here first
    lengths, sample_lag = mask.sum(-1)[has].float(), (trainer_version - small)[has]
    for value in sample_lag.unique().tolist():
        out[f"async/length_by_staleness/{value}"] = float(lengths[sample_lag == value].mean())
    return out


def sample_versions(batch: Batch) -> list[list[int]]:
    """Each sample's ``[first, last]`` weight version over its response tokens (a partial
    rollout resumed under new weights spans several), for the samples log."""
    mask = batch[LOSS_MASK].bool()
    versions = batch[TOKEN_WEIGHT_VERSION]
    first = torch.where(mask, versions, torch.iinfo(versions.dtype).max).amin(-1)
    last = torch.where(mask, versions, torch.iinfo(versions.dtype).min).amax(-1)
    has = mask.any(-1)
    # as lists: iterating the tensors would make a tensor per sample
    pairs = zip(first.tolist(), last.tolist(), has.tolist(), strict=True)
    return [[a, b] for a, b, h in pairs if h]
