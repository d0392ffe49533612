"""Preference pairs from local files, and the batch an engine trains on.

A row holds ``prompt`` (text, sent as one user message, or chat messages), ``chosen`` and
``rejected`` (text, or a list of assistant messages). Both answers are tokenized as SFT
tokenizes a chat (:func:`~drivetrain.trainer.data.tokenize.tokenize_row`): the prompt through
the chat template, the answer's tokens carry the loss mask, so a pair scores exactly the
tokens SFT trained.

A pair is two samples of the batch, chosen then rejected, sharing a ``sample_group`` value
(engines keep them in one micro-batch: the loss needs both); ``preference_chosen`` says which
is which.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from drivetrain.api import Batch
from drivetrain.api.columns import SAMPLE_GROUP
from drivetrain.trainer.column_contract import check_columns
from drivetrain.trainer.data.batching import make_batch
from drivetrain.trainer.data.files import iter_rows
from drivetrain.trainer.data.tokenize import (
    Example,
    LengthLimit,
    RowKeys,
    longest_token_chars,
    tokenize_row,
    truncate,
)
from drivetrain.trainer.dpo.config import PreferenceDataConfig
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.preflight import Context

#: per sample: 1 for the chosen answer of its pair, 0 for the rejected one
CHOSEN = "preference_chosen"
#: per sample: the reference model's summed log-prob of the answer tokens
REF_LOGPS = "ref_logps"
#: the data's precomputed reference log-probs (TRL's column names)
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")


@dataclass(frozen=True)
class Pair:
    chosen: Example
    rejected: Example
    ref_logps: tuple[float, float] | None = None  # precomputed (chosen, rejected)


def _messages(value: Any, role: str, where: str, key: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return [{"role": str(m.get("role", role)), "content": m.get("content")} for m in value]
    raise DataError(f"{where}: {key!r} must be a string or a list of chat messages")


def row_to_pair(
    row: Mapping[str, Any],
    tokenizer: Any,
    config: PreferenceDataConfig,
    limit: LengthLimit,
    where: str,
    *,
    precomputed: bool,
) -> Pair:
    keys = (config.prompt_key, config.chosen_key, config.rejected_key)
    missing = [k for k in keys if k not in row]
    if missing:
        found = ", ".join(sorted(map(str, row))) or "none"
        raise DataError(f"{where}: missing {', '.join(map(repr, missing))} (found: {found})")
    prompt = _messages(row[config.prompt_key], "user", where, config.prompt_key)
    examples = []
    for key in keys[1:]:
        answer = _messages(row[key], "assistant", where, key)
        example = tokenize_row(tokenizer, {"messages": prompt + answer}, RowKeys(), where, limit)
        kept = truncate(example, limit, where)
        if kept is None:
            raise DataError(f"{where}: the {key!r} answer has no token to score")
        examples.append(kept)
    ref = None
    if precomputed:
        if not all(k in row for k in REF_KEYS):
            raise DataError(f"{where}: reference.mode=precomputed needs {' and '.join(REF_KEYS)}")
        ref = (float(row[REF_KEYS[0]]), float(row[REF_KEYS[1]]))
    return Pair(examples[0], examples[1], ref)


def load_pairs(
    path: str,
    tokenizer: Any,
    config: PreferenceDataConfig,
    context: Context | None,
    *,
    precomputed: bool = False,
) -> list[Pair]:
    """The pairs of ``path``; a pair longer than ``data.max_length`` (or the model's context)
    is an error, never cut."""
    tokens, source = config.max_length, f"data.max_length={config.max_length}"
    if context is not None and context.tokens < tokens:
        tokens, source = context.tokens, context.source
    limit = LengthLimit(tokens, source, "error", longest_token_chars(tokenizer))
    pairs = [
        row_to_pair(row, tokenizer, config, limit, where, precomputed=precomputed)
        for where, row in iter_rows(path)
    ]
    if not pairs:
        raise DataError(f"data file {path!r} holds no preference pair")
    return pairs


def pair_batch(
    pairs: Sequence[Pair], *, pad_token_id: int, packed: bool, step: int | None = None
) -> Batch:
    """Chosen and rejected of every pair, in that order, as one batch (packed: one row)."""
    examples = [e for p in pairs for e in (p.chosen, p.rejected)]
    batch = make_batch(examples, pad_token_id=pad_token_id, packed=packed, step=step)
    columns: dict[str, Any] = {
        SAMPLE_GROUP: torch.arange(len(pairs)).repeat_interleave(2),
        CHOSEN: torch.tensor([1, 0] * len(pairs)),
    }
    if pairs and pairs[0].ref_logps is not None:
        columns[REF_LOGPS] = torch.tensor(
            [v for p in pairs for v in p.ref_logps or (0.0, 0.0)], dtype=torch.float64
        )
    return check_columns(batch.with_columns(**columns))
