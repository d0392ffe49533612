"""A user-registered policy loss: import this module through ``algorithm.plugins`` and select
it by name; the trainer is not edited.

    uv run drivetrain grpo algorithm.plugins=[examples.custom_policy_loss] \
        algorithm.policy_loss=clipped_reinforce
"""

from __future__ import annotations

from drivetrain.trainer.rl.policy_losses import (
    POLICY_LOSSES,
    ClipConfig,
    PolicyLossInputs,
    PolicyLossResult,
)


@POLICY_LOSSES.register("clipped_reinforce")
def clipped_reinforce(inputs: PolicyLossInputs, clip: ClipConfig) -> PolicyLossResult:
    """REINFORCE with the importance ratio clipped (no min with the unclipped term)."""
    ratio = (inputs.log_probs - inputs.old_log_probs).exp()
    clipped = ratio.clamp(1 - clip.low, 1 + clip.high)
    return -inputs.advantages * clipped.detach() * inputs.log_probs, {}
