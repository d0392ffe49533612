"""What a loss function receives and returns, and what it may ask the engine to compute.

Losses are passed per call (``engine.forward_backward(batch, loss_fn, outputs=...)``), so one
engine serves SFT, the PPO actor and the critic. The engine cuts the mini-batch into
micro-batches however it likes (fixed size, token budget, pipeline schedule); to keep the
result independent of that cut, a loss normalises by the *global* counts in
:class:`LossContext`, never by the micro-batch's own size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from drivetrain.api.batch import Batch
from drivetrain.api.columns import ENTROPY, LOG_PROBS, ROUTED_EXPERTS, VALUES


@dataclass(frozen=True)
class OutputSpec:
    """Which per-token outputs the engine computes for a loss or an ``infer`` call.

    ``log_probs`` and ``entropy`` are taken from logits divided by ``temperature`` (matching
    the rollout's sampling distribution). Engines compute them in chunks so that full-vocabulary
    logits never exist for the whole batch at once. ``values`` needs a value-head model.
    ``routed_experts`` (an engine with ``routing_replay``, a mixture-of-experts model): the
    experts its forward used for each token (``[.., layers, top_k]`` int16, the column's
    layout): those of the batch's ``routed_experts`` where it replays them, else its routers'.
    """

    log_probs: bool = True
    entropy: bool = False
    values: bool = False
    temperature: float = 1.0
    routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")

    @property
    def names(self) -> tuple[str, ...]:
        wanted = (
            (LOG_PROBS, self.log_probs),
            (ENTROPY, self.entropy),
            (VALUES, self.values),
            (ROUTED_EXPERTS, self.routed_experts),
        )
        return tuple(name for name, on in wanted if on)


@dataclass(frozen=True)
class LossContext:
    """Counts over the whole mini-batch on *all* data-parallel ranks, for normalisation.

    ``global_tokens`` counts tokens with ``loss_mask == 1``; ``global_sequences`` counts
    samples. ``micro_batch_index``/``num_micro_batches`` are for logging only: a loss whose value
    depends on them breaks micro-batch invariance.
    """

    global_tokens: int
    global_sequences: int
    dp_size: int
    micro_batch_index: int
    num_micro_batches: int


class LossFn(Protocol):
    """``loss_fn(outputs, micro_batch, ctx) -> (loss, metrics)``.

    ``outputs`` maps the names in the call's :class:`OutputSpec` to per-token values laid out
    like ``micro_batch["input_ids"]`` (padded ``[b, T]`` or packed ``[tokens]``). ``loss`` is a
    scalar of the engine's tensor type, this micro-batch's share of the mini-batch loss: the
    mini-batch loss is the *sum* of the returned losses over micro-batches and ranks. A token-mean
    loss is therefore ``(per_token * mask).sum() / ctx.global_tokens``. ``metrics`` are floats
    (or scalars) that the engine sums over micro-batches and ranks in the same way, except a
    name ending in ``_max``, whose largest value is kept (:func:`merge_metrics`).
    """

    def __call__(
        self, outputs: Mapping[str, Any], micro_batch: Batch, ctx: LossContext
    ) -> tuple[Any, Mapping[str, Any]]: ...


#: metric names with this ending are reduced by max, every other one by sum
MAX_SUFFIX = "_max"


def merge_metrics(totals: dict[str, float], metrics: Mapping[str, Any]) -> dict[str, float]:
    """Fold one micro-batch's (or rank's) loss ``metrics`` into ``totals``, in place: sums,
    and the largest value of a ``*_max`` metric (a maximum summed over micro-batches would
    depend on how the engine cut the batch). Returns ``totals``."""
    for name, value in metrics.items():
        value = float(value)
        if name not in totals:
            totals[name] = value
        elif name.endswith(MAX_SUFFIX):
            totals[name] = max(totals[name], value)
        else:
            totals[name] += value
    return totals
