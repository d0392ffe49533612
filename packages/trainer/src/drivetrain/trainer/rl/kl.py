"""Per-token estimators of KL(policy ‖ reference) from the two log-probs of sampled tokens.

With ``r = ref_log_prob - log_prob`` (log of the density ratio at the sampled token):

- ``k1 = -r``: unbiased, high variance, can be negative;
- ``k2 = r² / 2``: biased, low variance, its gradient is the true KL's gradient;
- ``k3 = exp(r) - 1 - r``: unbiased and always ≥ 0 (Schulman's "approximating KL"); clamped
  to ``±10`` as verl's ``low_var_kl`` does, because one token whose reference log-prob
  collapsed would otherwise dominate the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drivetrain.api.errors import ConfigError

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 10.0


@dataclass(frozen=True)
class KLConfig:
    """``algorithm.kl``: the penalty on KL(policy ‖ reference)."""

    coef: float = 0.0  # 0: no reference model is needed
    in_reward: bool = False  # True: PPO-style penalty in the reward; False: a loss term
    estimator: str = "k3"

    def __post_init__(self) -> None:
        if self.estimator not in KL_ESTIMATORS:
            raise ConfigError(
                f"algorithm.kl.estimator={self.estimator!r} is not one of {KL_ESTIMATORS}"
            )
        if self.coef < 0:
            raise ConfigError(f"algorithm.kl.coef={self.coef} must be >= 0")

    @property
    def loss_coef(self) -> float:
        """The coefficient of the KL as a loss term (GRPO's): 0 when it is in the reward. A
        non-zero one needs the reference's log-probs in the batch: RLConfig refuses a
        coefficient without a reference, and a reference without one."""
        return 0.0 if self.in_reward else self.coef


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    log_ratio = ref_log_probs - log_probs
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        log_ratio = log_ratio.clamp(-20.0, 20.0)  # exp() of a runaway ratio stays finite
        return (log_ratio.exp() - 1.0 - log_ratio).clamp(-K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {kind!r}; known: {', '.join(KL_ESTIMATORS)}")
