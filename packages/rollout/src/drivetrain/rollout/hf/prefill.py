"""Shared prompt prefill: a prompt sampled n times is run through the model once.

``generate`` would prefill every row of the batch, n identical copies of each prompt. Instead,
the distinct prompts are prefilled once (all but their last token), the KV cache is copied to
the rows that share them, and ``generate`` continues from there: the first step feeds each
row's last prompt token, so sampling starts from the same logits as without sharing.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def shared_prompt_cache(
    model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, groups: list[int]
) -> DynamicCache | None:
    """A KV cache over ``ids[:, :-1]`` (left-padded rows; ``mask`` 1 on real tokens) computed
    once per distinct prompt; ``groups[row]`` numbers each row's prompt (equal prompts, equal
    numbers, first seen first). ``None`` when no prompt repeats or prompts are one token."""
    distinct = max(groups) + 1 if groups else 0
    if distinct == len(groups) or ids.shape[1] < 2:
        return None
    first = [groups.index(g) for g in range(distinct)]
    head_ids, head_mask = ids[first, :-1], mask[first, :-1]
    positions = (head_mask.cumsum(-1) - 1).clamp(min=0)  # as generate derives them
    cache = DynamicCache(config=model.config)
    model(
        input_ids=head_ids,
        attention_mask=head_mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
    )
    cache.reorder_cache(torch.tensor(groups, device=ids.device))  # rows of a prompt share its
    return cache


def prompt_groups(prompts: list[tuple[int, ...]]) -> list[int]:
    """Each row's prompt number, by equal token ids (first seen first)."""
    seen: dict[tuple[int, ...], int] = {}
    return [seen.setdefault(p, len(seen)) for p in prompts]
