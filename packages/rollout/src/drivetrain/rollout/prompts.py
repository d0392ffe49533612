"""Prompts in (token ids or chat messages), checked against the context before generating."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, Prompt, Rollout, SamplingParams
from drivetrain.runtime.collector import call_requests
from drivetrain.runtime.request_poller import generate_with_requests


def render_prompts(prompts: Sequence[Prompt], tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """Token ids of every prompt; chat ``messages`` go through the tokenizer's chat template
    with the generation prompt added. Raises ``ValueError`` for ids outside the vocabulary."""
    if not prompts:
        raise ValueError("no prompts to generate from")
    rendered = []
    for i, prompt in enumerate(prompts):
        if prompt.messages:
            if getattr(tokenizer, "chat_template", None) is None:
                raise ValueError(
                    f"prompt {i} is chat messages but the tokenizer has no chat template"
                )
            ids = tokenizer.apply_chat_template(
                [dict(m) for m in prompt.messages],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        else:
            ids = list(prompt.token_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"prompt {i}: token ids {bad[:5]} outside the vocabulary ({vocab_size})"
            )
        if not ids:
            raise ValueError(f"prompt {i} renders to no tokens")
        rendered.append(ids)
    return rendered


def new_token_budgets(
    prompt_ids: Sequence[Sequence[int]], params: SamplingParams, max_model_len: int
) -> list[int]:
    """How many tokens each prompt may generate: ``max_new_tokens``, cut at the context length
    (such a completion finishes with ``length``). A prompt that leaves no room is an error."""
    budgets = []
    for i, ids in enumerate(prompt_ids):
        room = max_model_len - len(ids)
        if room < 1:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; the context (max_model_len={max_model_len}) "
                "leaves no room to generate"
            )
        budgets.append(min(params.max_new_tokens, room))
    return budgets


def check_stop_token_ids(params: SamplingParams, vocab_size: int) -> None:
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} outside the vocabulary ({vocab_size})")


def check_request(request: Request, vocab_size: int, max_model_len: int) -> None:
    """``ValueError`` for a request whose tokens leave the vocabulary or whose prompt plus
    ``max_new_tokens`` exceed the context (a request's budget is exact, never cut)."""
    what = f"request {request.request_id!r}"
    bad = [t for t in request.prompt_ids if not 0 <= t < vocab_size]
    bad += [t for t in request.params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"{what}: token ids {bad[:5]} outside the vocabulary ({vocab_size})")
    total = len(request.prompt_ids) + request.params.max_new_tokens
    if total > max_model_len:
        raise ValueError(
            f"{what}: {len(request.prompt_ids)} prompt tokens + max_new_tokens "
            f"{request.params.max_new_tokens} exceed the context (max_model_len={max_model_len})"
        )


def generate_prompts(
    rollout: Rollout,
    tokenizer: Any,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    *,
    vocab_size: int,
    max_model_len: int,
) -> list[Completion]:
    """Batch ``generate`` of a request-level rollout with a tokenizer: prompts rendered and
    checked, ``n`` requests per prompt (:func:`~drivetrain.runtime.collector.call_requests`) served
    through ``rollout``'s own submit/poll, each completion with its decoded text."""
    prompt_ids = render_prompts(prompts, tokenizer, vocab_size)
    budgets = new_token_budgets(prompt_ids, params, max_model_len)
    check_stop_token_ids(params, vocab_size)
    requests = call_requests(prompt_ids, budgets, params, seed=params.seed)
    return [
        replace(c, text=tokenizer.decode(c.token_ids, skip_special_tokens=True))
        for c in generate_with_requests(rollout, requests)
    ]
