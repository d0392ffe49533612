"""A warning, once per run, when the rollout's log-probs of the tokens it sampled drift from
the trainer's log-probs of the same tokens (``actor/rollout_log_prob_diff``). A healthy pair
agrees to rounding; a steady gap means the rollout samples from other weights (a lost
update, a bad cast) or another distribution than the trainer scores (temperature, top-p,
top-k), and training goes on silently off-policy."""

from __future__ import annotations

from collections.abc import Callable, Mapping

METRIC = "actor/rollout_log_prob_diff"


class LogProbAlarm:
    """``check`` every step's metrics; warns (through ``warn``) the first time the metric
    is above ``threshold``. ``threshold < 0``: off."""

    def __init__(self, threshold: float, warn: Callable[[str], object]) -> None:
        self.threshold = threshold
        self.warn = warn
        self.fired_at: int | None = None

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        value = metrics.get(METRIC)
        if value is None or self.threshold < 0 or self.fired_at is not None:
            return
        if value > self.threshold:
            self.fired_at = step
            self.warn(
                f"warning: step {step}: {METRIC} is {value:.4f}, above {self.threshold:g} "
                "(run.log_prob_alarm): the rollout does not sample what the trainer scores. "
                "Check that it serves the synced weights (weight_sync.provenance=true) in the "
                "dtype you expect, and samples with the trainer's temperature, top-p and top-k"
            )
