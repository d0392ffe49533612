"""A custom reward, used by dotted path: ``reward.functions=[examples.custom_reward:brevity]``
(run from the repository root so ``examples`` is importable) or with your package's path.

A reward function is ``fn(response: str, ground_truth: str) -> float``.
"""

from __future__ import annotations

from drivetrain.trainer.rl.rewards import numeric_match


def brevity(response: str, ground_truth: str) -> float:
    """The numeric answer's reward, minus a little for every word beyond the first."""
    return numeric_match(response, ground_truth) - 0.01 * max(0, len(response.split()) - 1)
