"""The RL job's end-of-run summary: the greedy validation change and the rollout-vs-trainer
log-prob gap over the steps (issue 57, item 1)."""

from __future__ import annotations

from pathlib import Path

from drivetrain.trainer.commands.rl import greedy_delta, log_prob_gap, rl_summary
from drivetrain.trainer.rl.trainer import RLResult


def test_greedy_delta_prefers_exact_match_and_needs_both_ends():
    before = {"val/exact_match": 0.945, "val/mean": 0.5}
    after = {"val/exact_match": 0.9, "val/mean": 0.75}
    assert greedy_delta(before, after) == 0.9 - 0.945  # a drop stays a drop
    assert greedy_delta({"val/mean": 0.5}, {"val/mean": 0.75}) == 0.25
    assert greedy_delta({}, after) is None


def test_the_gap_names_its_worst_step_and_largest_token(tmp_path: Path):
    result = RLResult(tmp_path, final_step=3, log_prob_alarm=0.002)
    assert log_prob_gap(result) is None  # no step reported one (e.g. no rollout log-probs)
    result.log_prob_gaps.update({1: (1e-7, 2e-6), 2: (3e-3, 0.4), 3: (2e-7, 5e-6)})
    gap = log_prob_gap(result)
    assert gap == {
        "steps": 3, "mean": (1e-7 + 3e-3 + 2e-7) / 3, "max": 3e-3, "max_step": 2,
        "token_max": 0.4, "alarm": 0.002,
    }  # fmt: skip
    summary, _ = rl_summary(result, tmp_path)
    assert summary["log_prob_gap"] == gap and summary["greedy_delta"] is None
