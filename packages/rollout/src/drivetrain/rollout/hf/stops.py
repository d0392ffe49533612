"""Where a generated sequence ends: the first stop token or stop string, else its budget."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from drivetrain.api.rollout import FinishReason


def cut_at_stop(
    tokens: Sequence[int],
    budget: int,
    stop_ids: Collection[int],
    stop_strings: Sequence[str],
    decode: Callable[[Sequence[int]], str],
) -> tuple[int, FinishReason]:
    """Number of tokens to keep and why generation ended.

    A stop token is kept (as vLLM does for EOS); a stop string ends the output at the token
    that completes it.
    """
    limit = min(len(tokens), budget)
    end, reason = limit, FinishReason.LENGTH
    for i, token in enumerate(tokens[:limit]):
        if token in stop_ids:
            end, reason = i + 1, FinishReason.STOP
            break
    if stop_strings:
        text = decode(tokens[:end])
        if any(s in text for s in stop_strings):
            # the shortest prefix whose text holds a stop string
            lo, hi = 1, end
            while lo < hi:
                mid = (lo + hi) // 2
                if any(s in decode(tokens[:mid]) for s in stop_strings):
                    hi = mid
                else:
                    lo = mid + 1
            end, reason = lo, FinishReason.STOP
    return end, reason
