"""Turn SFT rows into token ids and a loss mask.

Two row shapes are accepted: ``{"prompt": ..., "response": ...}`` and chat ``{"messages": [...]}``
(OpenAI-style ``role``/``content`` dicts, with an optional ``tools`` list of JSON schemas the
template renders). Chat rows go through the tokenizer's chat template and the loss covers
assistant turns only. Prompt/response rows use the chat template too when the
tokenizer has one (as a user and an assistant turn), else plain text + EOS.

Assistant tokens are found by rendering the conversation up to each assistant turn with and
without that turn and masking the characters in between (via the fast tokenizer's offsets), so
any template works as long as rendering a prefix of the conversation gives a prefix of the text.

Characters are bounded before tokenising: tokenising costs hundreds of bytes per character
(one 50 MB row took > 8 GB), and no token covers more characters than the tokenizer's longest
vocabulary entry, so a text longer than ``max_tokens x`` that many characters cannot fit.
Such a row is refused under ``truncation=error`` without being tokenised; under ``left`` or
``right`` each message is first cut to that many characters on the kept side (tokens next to
the cut may differ from those of the whole text; the cut lies one token's worth of characters
beyond what the kept tokens can cover).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from drivetrain.trainer.errors import DataError


@dataclass(frozen=True)
class Example:
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  # 1 where the token is a training target

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True)
class LengthLimit:
    """The most tokens an example may have, what sets that limit (named in errors), the
    truncation policy, and the most characters one token of the tokenizer covers."""

    max_tokens: int
    source: str  # "data.max_length=1024", "the model's context (max_position_embeddings=256)"
    policy: str
    chars_per_token: int

    @property
    def max_chars(self) -> int:
        """Text longer than this (message contents summed) has more than ``max_tokens``."""
        return self.max_tokens * self.chars_per_token


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry: no token covers more characters of the text
    (byte-level and SentencePiece entries spell one character per byte or character they
    cover). Characters a normaliser would remove count too: such text is refused, not missed."""
    return max(map(len, tokenizer.get_vocab()), default=1)


@dataclass(frozen=True)
class RowKeys:
    prompt: str = "prompt"
    response: str = "response"
    messages: str = "messages"


def row_to_messages(row: Mapping[str, Any], keys: RowKeys, where: str) -> list[dict[str, str]]:
    """The row as a list of chat messages, validated."""
    if keys.messages in row:
        messages = row[keys.messages]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: '{keys.messages}' must be a non-empty list of messages")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise DataError(f"{where}: message {i} needs 'role' and 'content'")
            if not isinstance(m["content"], str):
                raise DataError(f"{where}: message {i} content must be a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message, so nothing to train on")
        return [{"role": str(m["role"]), "content": m["content"]} for m in messages]
    if keys.prompt in row and keys.response in row:
        prompt, response = row[keys.prompt], row[keys.response]
        if not isinstance(prompt, str) or not isinstance(response, str):
            raise DataError(f"{where}: '{keys.prompt}' and '{keys.response}' must be strings")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    found = ", ".join(sorted(map(str, row))) or "none"
    raise DataError(
        f"{where}: expected '{keys.messages}' or '{keys.prompt}'+'{keys.response}' keys, "
        f"found: {found}"
    )


def _render(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    *,
    generation: bool,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=generation
    )


def row_tools(row: Mapping[str, Any], where: str) -> list[dict[str, Any]] | None:
    """A chat row's ``tools`` (JSON schemas the chat template renders, as TRL's SFT takes
    them), or ``None``."""
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise DataError(f"{where}: 'tools' must be a list of JSON schema objects")
    return [dict(t) for t in tools] or None


def tokenize_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, str]],
    where: str,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> Example:
    """Chat-template tokens with a loss mask over the assistant turns (``tools`` rendered by
    the template, as at generation time)."""
    text = _render(tokenizer, messages, generation=False, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation=True, tools=tools) if i else ""
        through = _render(tokenizer, messages[: i + 1], generation=False, tools=tools)
        if not (text.startswith(through) and through.startswith(before)):
            raise DataError(
                f"{where}: the chat template does not render conversation prefixes as text "
                "prefixes, so assistant tokens cannot be located"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    mask = [int(any(lo <= start < hi for lo, hi in spans)) for start, _ in offsets]
    return Example(tuple(ids), tuple(mask))


def tokenize_plain(tokenizer: Any, prompt: str, response: str) -> Example:
    """No chat template: prompt tokens (with BOS if the tokenizer adds one), response, EOS."""
    prompt_ids = tokenizer(prompt)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        response_ids = [*response_ids, tokenizer.eos_token_id]
    ids = [*prompt_ids, *response_ids]
    return Example(tuple(ids), tuple([0] * len(prompt_ids) + [1] * len(response_ids)))


def fit_characters(
    messages: list[dict[str, str]], limit: LengthLimit, where: str
) -> list[dict[str, str]]:
    """Bound the characters before tokenising (see the module docstring)."""
    chars = sum(len(m["content"]) for m in messages)
    if chars <= limit.max_chars:
        return messages
    if limit.policy == "error":
        raise DataError(
            f"{where}: {chars:,} characters cannot fit in {limit.max_tokens} tokens "
            f"({limit.source}; no token of this tokenizer covers more than "
            f"{limit.chars_per_token} characters); set data.truncation=left or right to cut "
            "such examples"
        )
    # one token more than the limit, so the last kept token is never the one cut in two
    keep = limit.max_chars + limit.chars_per_token
    window = slice(-keep, None) if limit.policy == "left" else slice(keep)
    return [{**m, "content": m["content"][window]} for m in messages]


def tokenize_row(
    tokenizer: Any, row: Mapping[str, Any], keys: RowKeys, where: str, limit: LengthLimit
) -> Example:
    """The row's tokens, its characters bounded by ``limit`` first (tokens are cut by
    :func:`truncate`)."""
    messages = fit_characters(row_to_messages(row, keys, where), limit, where)
    if getattr(tokenizer, "chat_template", None):
        return tokenize_chat(tokenizer, messages, where, row_tools(row, where))
    if keys.messages in row:
        raise DataError(f"{where}: chat rows need a tokenizer with a chat template")
    return tokenize_plain(tokenizer, messages[0]["content"], messages[1]["content"])


def truncate(example: Example, limit: LengthLimit, where: str) -> Example | None:
    """Apply the truncation policy; ``None`` when nothing to train on is left."""
    max_length = limit.max_tokens
    if len(example) > max_length:
        if limit.policy == "error":
            raise DataError(
                f"{where}: {len(example)} tokens is longer than {limit.source} "
                "(set data.truncation=left or right to cut such examples)"
            )
        cut = (
            slice(len(example) - max_length, None) if limit.policy == "left" else slice(max_length)
        )
        example = Example(example.input_ids[cut], example.loss_mask[cut])
    # Position 0 has no prediction (columns.py), so it can never be a target.
    mask = (0, *example.loss_mask[1:])
    if not any(mask):
        return None
    return Example(example.input_ids, mask)


def pad_token_id(tokenizer: Any) -> int:
    """The tokenizer's pad token, else its EOS (padding is masked out either way), else 0."""
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return int(pad)
