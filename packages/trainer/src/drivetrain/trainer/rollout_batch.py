"""Completions from any rollout backend as a training batch.

Columns (token columns aligned with ``input_ids``, prompt then response):
``input_ids``, ``response_mask`` and ``loss_mask`` (1 on generated tokens: a multi-turn
:class:`~drivetrain.trainer.trajectory.Trajectory`'s observation tokens are 0),
``rollout_log_probs`` (the sampled log-prob on generated tokens, 0 on the prompt),
``token_weight_version`` (each generated token's weight version, -1 on the prompt), and per
sample ``prompt_index``, ``weight_version`` and ``finish_reason``. Values are plain lists; pass
``as_tensor`` (e.g. ``torch.tensor``) to get tensors. Standard library only, so the trainer can
build the batch from completions that crossed a process boundary as plain data.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from drivetrain.api.batch import Batch, BatchMeta, Layout
from drivetrain.api.columns import (
    INPUT_IDS,
    LOSS_MASK,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    TOKEN_WEIGHT_VERSION,
    WEIGHT_VERSION,
)
from drivetrain.api.rollout import Completion
from drivetrain.trainer.trajectory import OBSERVATION_VERSION, sampled_mask

PROMPT_INDEX = "prompt_index"
FINISH_REASON = "finish_reason"
PROMPT_LENGTH = "prompt_length"


def completions_to_batch(
    completions: Sequence[Completion],
    *,
    pad_token_id: int,
    packed: bool = False,
    as_tensor: Callable[[Any], Any] | None = None,
    meta: BatchMeta | None = None,
) -> Batch:
    """One sample per completion: its prompt followed by its generated tokens.

    Padded batches are right-padded with ``pad_token_id`` (masks and log-probs with 0);
    packed batches concatenate the sequences (``Layout.PACKED``).
    """
    if not completions:
        raise ValueError("no completions to batch")
    rows: dict[str, list[list[Any]]] = {
        INPUT_IDS: [],
        RESPONSE_MASK: [],
        LOSS_MASK: [],
        ROLLOUT_LOG_PROBS: [],
        TOKEN_WEIGHT_VERSION: [],
    }
    for c in completions:
        if len(c.log_probs) != len(c.token_ids):
            raise ValueError(
                f"completion of prompt {c.prompt_index}: {len(c.token_ids)} tokens but "
                f"{len(c.log_probs)} log-probs"
            )
        prompt, response = list(c.prompt_ids), list(c.token_ids)
        generated = [0] * len(prompt) + sampled_mask(c)
        rows[INPUT_IDS].append(prompt + response)
        rows[RESPONSE_MASK].append(generated)
        rows[LOSS_MASK].append(list(generated))
        rows[ROLLOUT_LOG_PROBS].append([0.0] * len(prompt) + [float(x) for x in c.log_probs])
        versions = list(c.token_versions) or [
            c.weight_version if s else OBSERVATION_VERSION for s in sampled_mask(c)
        ]
        if len(versions) != len(response):
            raise ValueError(
                f"completion of prompt {c.prompt_index}: {len(response)} tokens but "
                f"{len(versions)} token versions"
            )
        rows[TOKEN_WEIGHT_VERSION].append([-1] * len(prompt) + versions)
    seq_lens = [len(r) for r in rows[INPUT_IDS]]
    pads = {
        INPUT_IDS: pad_token_id,
        RESPONSE_MASK: 0,
        LOSS_MASK: 0,
        ROLLOUT_LOG_PROBS: 0.0,
        TOKEN_WEIGHT_VERSION: -1,
    }
    columns: dict[str, Any] = {}
    for name, values in rows.items():
        if packed:
            columns[name] = [x for row in values for x in row]
        else:
            width = max(seq_lens)
            columns[name] = [row + [pads[name]] * (width - len(row)) for row in values]
    columns[PROMPT_INDEX] = [c.prompt_index for c in completions]
    columns[PROMPT_LENGTH] = [len(c.prompt_ids) for c in completions]
    versions = [c.weight_version for c in completions]
    columns[WEIGHT_VERSION] = list(versions)
    if as_tensor is not None:
        columns = {k: as_tensor(v) for k, v in columns.items()}
    columns[FINISH_REASON] = [c.finish_reason.value for c in completions]
    return Batch.from_columns(
        columns,
        seq_lens=seq_lens,
        layout=Layout.PACKED if packed else Layout.PADDED,
        meta=meta or BatchMeta(pad_token_id=pad_token_id, weight_version=_uniform(versions)),
    )


def _uniform(values: Sequence[int]) -> int | None:
    return values[0] if len(set(values)) == 1 else None
