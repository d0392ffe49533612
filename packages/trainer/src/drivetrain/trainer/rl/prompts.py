"""RL prompts from local JSONL/JSON/Parquet rows: a prompt (text or chat messages) and the
ground truth a reward checks.

A row holds ``prompt_key`` (a string, sent as one user message when the tokenizer has a chat
template) or ``messages_key`` (chat messages; a final assistant message is dropped and, when
the row has no ``answer_key``, becomes the ground truth: SFT data works as RL prompts).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.trainer.data.files import read_rows
from drivetrain.trainer.errors import DataError


@dataclass(frozen=True)
class RLPrompt:
    token_ids: tuple[int, ...]
    ground_truth: str
    text: str


def _messages(row: Mapping[str, Any], prompt_key: str, messages_key: str) -> list[dict]:
    if messages_key in row:
        return [dict(m) for m in row[messages_key]]
    if prompt_key in row:
        return [{"role": "user", "content": str(row[prompt_key])}]
    raise KeyError(prompt_key)


def rows_to_prompts(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    *,
    prompt_key: str,
    messages_key: str,
    answer_key: str,
    max_prompt_length: int,
    source: str,
) -> list[RLPrompt]:
    out: list[RLPrompt] = []
    chat = getattr(tokenizer, "chat_template", None) is not None
    for i, row in enumerate(rows):
        try:
            messages = _messages(row, prompt_key, messages_key)
        except KeyError:
            raise DataError(
                f"{source} row {i}: neither {prompt_key!r} nor {messages_key!r} is present"
            ) from None
        truth = row.get(answer_key)
        if messages and messages[-1].get("role") == "assistant":
            last = messages.pop()
            truth = last["content"] if truth is None else truth
        if truth is None:
            raise DataError(f"{source} row {i}: no ground truth ({answer_key!r})")
        if chat:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if len(ids) > max_prompt_length:
            continue  # too long to generate from within the budget: dropped (counted by caller)
        out.append(RLPrompt(tuple(ids), str(truth), text))
    return out


def load_prompts(path: str, tokenizer: Any, **kwargs: Any) -> tuple[list[RLPrompt], int]:
    """Prompts of ``path`` and how many rows were dropped as too long."""
    rows = read_rows(path)
    prompts = rows_to_prompts(rows, tokenizer, source=path, **kwargs)
    if not prompts:
        raise DataError(f"{path}: no usable prompt (all {len(rows)} rows too long or empty)")
    return prompts, len(rows) - len(prompts)


class PromptSampler:
    """Prompts for step ``k``: a fixed function of (seed, k), so a resumed run sees what an
    uninterrupted one would have (epoch-wise shuffles, no repeats within an epoch)."""

    def __init__(self, count: int, per_step: int, seed: int) -> None:
        if per_step > count:
            raise DataError(f"{per_step} prompts per step, but the data has only {count}")
        self.count, self.per_step, self.seed = count, per_step, seed
        self.steps_per_epoch = count // per_step
        self._epoch: tuple[int, list[int]] = (-1, [])

    def indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._epoch[0] != epoch:  # one shuffle per epoch, not per step
            order = list(range(self.count))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch = (epoch, order)
        return self._epoch[1][within * self.per_step : (within + 1) * self.per_step]
