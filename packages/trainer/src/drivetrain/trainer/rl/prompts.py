"""RL prompts from local JSONL/JSON/Parquet rows: a prompt (text or chat messages) and the
ground truth a reward checks.

A row holds ``prompt_key`` (a string, sent as one user message when the tokenizer has a chat
template) or ``messages_key`` (chat messages; a final assistant message is dropped and, when
the row has no ``answer_key``, becomes the ground truth: SFT data works as RL prompts).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from drivetrain.trainer.data.files import Row, iter_rows
from drivetrain.trainer.data.tokenize import longest_token_chars
from drivetrain.trainer.errors import DataError
from drivetrain.trainer.preflight import Context


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


def row_ground_truth(row: Mapping[str, Any], answer_key: str, messages_key: str) -> str | None:
    """What a reward checks a row's responses against, on every path (plain prompts and
    episodes): its ``answer_key``, else the content of a final assistant message under
    ``messages_key`` (SFT data as RL prompts); None when it has neither."""
    answer = row.get(answer_key)
    if answer is not None:
        return str(answer)
    messages = row.get(messages_key)
    if isinstance(messages, list | tuple) and messages and isinstance(messages[-1], Mapping):
        last = messages[-1]
        if last.get("role") == "assistant" and last.get("content") is not None:
            return str(last["content"])
    return None


def missing_ground_truth(where: str, answer_key: str, messages_key: str) -> str:
    """The one line saying that the row at ``where`` has no ground truth, and what it lacks."""
    return (
        f"{where}: no ground truth: neither {answer_key!r} (data.answer_key) nor a final "
        f"assistant message in {messages_key!r} (data.messages_key)"
    )


def rows_to_prompts(
    rows: Iterable[Row],
    tokenizer: Any,
    *,
    prompt_key: str,
    messages_key: str,
    answer_key: str,
    max_prompt_length: int,
    max_new_tokens: int,
    context: Context,
) -> tuple[list[RLPrompt], int]:
    """The prompts, and how many rows were dropped as longer than ``max_prompt_length``. A kept
    prompt that leaves no room for ``max_new_tokens`` in ``context`` is an error: its samples
    would be cut short or fail in a later step."""
    out: list[RLPrompt] = []
    dropped = 0
    chat = getattr(tokenizer, "chat_template", None) is not None
    # no token covers more characters than this: a longer prompt is dropped untokenised
    max_chars = max_prompt_length * longest_token_chars(tokenizer)
    for where, row in rows:
        try:
            messages = _messages(row, prompt_key, messages_key)
        except KeyError:
            raise DataError(
                f"{where}: neither {prompt_key!r} nor {messages_key!r} is present"
            ) from None
        truth = row_ground_truth(row, answer_key, messages_key)
        if messages and messages[-1].get("role") == "assistant":
            messages.pop()  # the answer: the ground truth when the row has no answer_key
        if truth is None:
            raise DataError(missing_ground_truth(where, answer_key, messages_key))
        if sum(len(str(m.get("content", ""))) for m in messages) > max_chars:
            dropped += 1
            continue
        if chat:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        else:
            text = "\n".join(m["content"] for m in messages)
        ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
        if len(ids) > max_prompt_length:
            dropped += 1  # too long to generate from within the budget
            continue
        if len(ids) + max_new_tokens > context.tokens:
            raise DataError(
                f"{where}: {len(ids)} prompt tokens + sampling.max_new_tokens={max_new_tokens} "
                f"exceed {context.source}; lower data.max_prompt_length to drop such prompts, "
                "or sampling.max_new_tokens"
            )
        out.append(RLPrompt(tuple(ids), truth, text))
    return out, dropped


def load_prompts(path: str, tokenizer: Any, **kwargs: Any) -> tuple[list[RLPrompt], int]:
    """Prompts of ``path`` (streamed row by row) and how many rows were dropped as too long."""
    prompts, dropped = rows_to_prompts(iter_rows(path), tokenizer, **kwargs)
    if not prompts:
        raise DataError(f"{path}: no usable prompt (all {dropped} rows too long, or none)")
    return prompts, dropped


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

    def extra(self, step: int, start: int, count: int) -> list[int]:
        """Prompts ``start .. start + count`` of step ``step``'s extra ones (dynamic sampling's
        further rounds): one fixed permutation per (seed, step) of the prompts the step does
        not hold, so later rounds never repeat an earlier round's prompts (until it runs
        out and starts over)."""
        held = set(self.indices(step))
        rest = [i for i in range(self.count) if i not in held] or list(range(self.count))
        random.Random((self.seed * 1_000_003 + step) * 10_007).shuffle(rest)
        return [rest[(start + k) % len(rest)] for k in range(min(count, len(rest)))]
