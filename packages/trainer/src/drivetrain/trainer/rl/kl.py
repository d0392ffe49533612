"""Per-token estimators of KL(policy ‖ reference) from the two log-probs of sampled tokens.

With ``r = ref_log_prob - log_prob`` (log of the density ratio at the sampled token):

- ``k1 = -r``: unbiased, high variance, can be negative;
- ``k2 = r² / 2``: biased, low variance, its gradient is the true KL's gradient;
- ``k3 = exp(r) - 1 - r``: unbiased and always ≥ 0 (Schulman's "approximating KL"); clamped
  to ``±10`` as verl's ``low_var_kl`` does, because one token whose reference log-prob
  collapsed would otherwise dominate the batch.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLAMP = 10.0


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
