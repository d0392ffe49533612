"""The built-in GRPO job under ``numerics=exact``: 20 steps, each with a weight sync (delta in
float32, full in bfloat16), prompts of every length the task has, 12 prompts x 8 samples
joining a rollout that runs at most 40 at once (so decode batches shrink and refill), and
training micro-batches of at most 700 tokens (not the rollout's batches): the rollout's
log-prob of every sampled token equals the actor's bit for bit at every step. The session's
built-in run (default numerics, float32) shows the gap this closes."""

from __future__ import annotations

import json
import sys

import pytest

from builtin_run import BUILTIN_ADDITION
from cli_run import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900), BUILTIN_ADDITION]

SETTINGS = {
    "float32": ("weight_sync.delta=true",),
    "bfloat16": ("actor.model.dtype=bfloat16", "rollout.dtype=bfloat16", "weight_sync.delta=false"),
}


def steps_of(out) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "actor/rollout_log_prob_diff" in r]


def exact_steps(tmp_path, builtin_addition, *args: str) -> list[dict]:
    """``drivetrain grpo numerics=exact *args`` from the session's cached SFT model: its steps'
    metric rows."""
    out = tmp_path / "exact"
    done = run_cli(
        "grpo", "numerics=exact", f"run.output_dir={out}", "logging.progress=false", *args,
        env=builtin_addition.env(), cwd=tmp_path, timeout=800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return steps_of(out)


@pytest.mark.parametrize("dtype", sorted(SETTINGS))
def test_the_builtin_job_is_bitwise_on_policy(tmp_path, builtin_addition, dtype):
    steps = exact_steps(
        tmp_path, builtin_addition, "run.steps=20", "run.prompts_per_step=12",
        "rollout.max_batch_size=40", "actor.micro_batch.max_tokens=700", "data.val_size=16",
        *SETTINGS[dtype],
    )  # fmt: skip
    assert len(steps) == 20
    gaps = [(r["actor/rollout_log_prob_diff"], r["actor/rollout_log_prob_diff_max"]) for r in steps]
    assert gaps == [(0.0, 0.0)] * 20, gaps
    assert len({r["response/length_mean"] for r in steps}) > 1  # the batches differ


def test_default_numerics_have_the_gap(builtin_addition):
    gaps = [r["actor/rollout_log_prob_diff"] for r in steps_of(builtin_addition.out)]
    assert len(gaps) == 120 and max(gaps) > 0, max(gaps)


def test_async_tokens_of_the_current_weights_are_bitwise(tmp_path, builtin_addition):
    """Async with partial rollouts (the scripted schedule: two rounds of generation during
    each update, samples up to 2 versions behind): the tokens sampled by the weights the
    update starts from have the trainer's log-probs bit for bit; the stale ones differ (other
    weights), which is what the off-policy correction is for."""
    steps = exact_steps(
        tmp_path, builtin_addition, "algorithm.mode=async", "algorithm.ahead.max_staleness=2",
        "algorithm.ahead.scripted_rounds=2", "run.steps=8", "data.val_size=8",
    )  # fmt: skip
    assert [r["actor/current_weights_log_prob_diff_max"] for r in steps] == [0.0] * 8
    mixed = [r for r in steps if 0 < r.get("async/staleness_frac/0", 0) < 1]
    assert mixed and all(r["actor/rollout_log_prob_diff_max"] > 0 for r in mixed), steps


def test_a_rollout_server_process_is_bitwise(tmp_path, builtin_addition):
    """The hf rollout in a server process (``rollout.python``: weights cross as bytes, tokens
    and log-probs as plain data): its log-probs still agree with the trainer's bit for bit."""
    steps = exact_steps(
        tmp_path, builtin_addition, f"rollout.python={sys.executable}", "run.steps=4",
        "data.val_size=8",
    )  # fmt: skip
    assert [r["actor/rollout_log_prob_diff_max"] for r in steps] == [0.0] * 4


def test_two_epochs_start_from_a_ratio_of_exactly_one(tmp_path, builtin_addition):
    """With two PPO epochs the old log-probs come from a forward of their own: they equal the
    rollout's bit for bit, and the first update's ratio to them is exactly 1."""
    steps = exact_steps(
        tmp_path, builtin_addition, "algorithm.ppo_epochs=2", "run.steps=4", "data.val_size=8"
    )
    assert [r["rollout/log_prob_diff_max"] for r in steps] == [0.0] * 4
    assert [r["actor/first_update_log_ratio_max"] for r in steps] == [0.0] * 4
