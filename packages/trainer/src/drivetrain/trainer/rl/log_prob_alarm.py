"""A warning, once per run, when the rollout's log-probs of the tokens it sampled drift from
the trainer's log-probs of the same tokens (``actor/rollout_log_prob_diff``). A healthy pair
agrees to rounding; a steady gap means the rollout samples from other weights (a lost
update, a bad cast) or another distribution than the trainer scores (temperature, top-p,
top-k), and training goes on silently off-policy."""

from __future__ import annotations

from collections.abc import Callable, Mapping

METRIC = "actor/rollout_log_prob_diff"
#: under numerics=exact, the gap of the tokens the step's starting weights sampled: the old
#: log-probs' forward where one runs, the current version's tokens in async modes, else the
#: (only) update's forward
EXACT_METRICS = (
    "rollout/log_prob_diff_max",
    "actor/current_weights_log_prob_diff_max",
    "actor/rollout_log_prob_diff_max",
)


class LogProbAlarm:
    """``check`` every step's metrics; warns (through ``warn``) the first time the metric
    is above ``threshold``; under ``exact`` numerics the first time any such token's gap is
    not 0. ``threshold < 0``: off."""

    def __init__(
        self, threshold: float, warn: Callable[[str], object], *, exact: bool = False
    ) -> None:
        self.threshold = threshold
        self.warn = warn
        self.exact = exact
        self.fired_at: int | None = None

    def check(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.threshold < 0 or self.fired_at is not None:
            return
        if self.exact:
            self._check_exact(step, metrics)
            return
        value = metrics.get(METRIC)
        if value is None:
            return
        if value > self.threshold:
            self.fired_at = step
            self.warn(
                f"warning: step {step}: {METRIC} is {value:.4f}, above {self.threshold:g} "
                "(run.log_prob_alarm): the rollout does not sample what the trainer scores. "
                "Check that it serves the synced weights (weight_sync.provenance=true) in the "
                "dtype you expect, and samples with the trainer's temperature, top-p and top-k"
            )

    def _check_exact(self, step: int, metrics: Mapping[str, float]) -> None:
        name = next((m for m in EXACT_METRICS if m in metrics), None)
        if name is None or metrics[name] == 0.0:
            return
        self.fired_at = step
        self.warn(
            f"warning: step {step}: numerics=exact, but {name} is {metrics[name]:.3g}: the "
            "rollout's log-probs are not the trainer's bit for bit here. `drivetrain diagnose "
            "mismatch MODEL --numerics exact` names the first op where they part"
        )
