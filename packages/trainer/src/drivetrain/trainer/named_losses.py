"""Loss functions by name, so a worker in another process is told which one to use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from drivetrain.api import Batch, LossContext, LossFn
from drivetrain.api.columns import LOG_PROBS, LOSS_MASK


def sft_loss(
    outputs: Mapping[str, Any], micro_batch: Batch, ctx: LossContext
) -> tuple[Any, Mapping[str, Any]]:
    """Token-mean negative log-likelihood over ``loss_mask`` tokens of the whole mini-batch."""
    mask = micro_batch[LOSS_MASK].to(outputs[LOG_PROBS].dtype)
    nll = -(outputs[LOG_PROBS] * mask).sum()
    return nll / ctx.global_tokens, {}


LOSSES: dict[str, LossFn] = {"sft": sft_loss}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise KeyError(f"unknown loss {name!r}; known: {', '.join(sorted(LOSSES))}")
    return LOSSES[name]
