"""Load, tokenize and split an SFT dataset, failing before any training if something is off."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.trainer.data.files import iter_rows
from drivetrain.trainer.data.tokenize import (
    Example,
    LengthLimit,
    RowKeys,
    longest_token_chars,
    tokenize_row,
    truncate,
)
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.preflight import Context
from drivetrain.trainer.sft.config import DataConfig


@dataclass(frozen=True)
class SFTData:
    train: tuple[Example, ...]
    val: tuple[Example, ...]
    dropped: int  # examples left with no target token after truncation

    @property
    def train_tokens(self) -> int:
        return sum(len(e) for e in self.train)


def length_limit(config: DataConfig, tokenizer: Any, context: Context | None) -> LengthLimit:
    """``data.max_length``, or the model's context where that is shorter."""
    tokens, source = config.max_length, f"data.max_length={config.max_length}"
    if context is not None and context.tokens < tokens:
        tokens, source = context.tokens, context.source
    return LengthLimit(tokens, source, config.truncation, longest_token_chars(tokenizer))


def tokenize_file(
    path: str, tokenizer: Any, config: DataConfig, context: Context | None = None
) -> tuple[list[Example], int]:
    """Examples of ``path`` (streamed row by row) and how many lost every target token to
    truncation; ``context``: the model's, when known."""
    keys = RowKeys(config.prompt_key, config.response_key, config.messages_key)
    limit = length_limit(config, tokenizer, context)
    examples, dropped = [], 0
    for where, row in iter_rows(path):
        example = truncate(tokenize_row(tokenizer, row, keys, where, limit), limit, where)
        if example is None:
            dropped += 1
        else:
            examples.append(example)
    if not examples:
        reason = f" ({dropped} rows lost every target token to truncation)" if dropped else ""
        raise DataError(f"data file {path!r} holds no usable example{reason}")
    return examples, dropped


def split_validation(
    examples: Sequence[Example], ratio: float, seed: int
) -> tuple[list[Example], list[Example]]:
    """Hold out ``ratio`` of the examples (at least one), chosen with ``seed``."""
    if ratio <= 0:
        return list(examples), []
    count = max(1, round(len(examples) * ratio))
    if count >= len(examples):
        raise DataError(f"data.val_ratio={ratio} leaves no training example")
    held = set(random.Random(seed).sample(range(len(examples)), count))
    train = [e for i, e in enumerate(examples) if i not in held]
    return train, [e for i, e in enumerate(examples) if i in held]


def load_sft_data(
    config: DataConfig, tokenizer: Any, seed: int, context: Context | None = None
) -> SFTData:
    train, dropped = tokenize_file(config.train_path, tokenizer, config, context)
    if config.val_path:
        val, val_dropped = tokenize_file(config.val_path, tokenizer, config, context)
        dropped += val_dropped
    else:
        train, val = split_validation(train, config.val_ratio, seed)
    return SFTData(tuple(train), tuple(val), dropped)
