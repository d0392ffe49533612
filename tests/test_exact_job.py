"""The built-in GRPO job under ``numerics=exact``: 20 steps, each with a weight sync (delta in
float32, full in bfloat16), prompts of every length the task has, 12 prompts x 8 samples
joining a rollout that runs at most 40 at once (so decode batches shrink and refill), and
training micro-batches of at most 700 tokens (not the rollout's batches): the rollout's
log-prob of every sampled token equals the actor's bit for bit at every step. The session's
built-in run (default numerics, float32) shows the gap this closes."""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("dtype", sorted(SETTINGS))
def test_the_builtin_job_is_bitwise_on_policy(tmp_path, builtin_addition, dtype):
    out = tmp_path / "exact"
    done = run_cli(
        "grpo", "numerics=exact", "run.steps=20", "run.prompts_per_step=12",
        "rollout.max_batch_size=40", "actor.micro_batch.max_tokens=700", "data.val_size=16",
        f"run.output_dir={out}", "logging.progress=false", *SETTINGS[dtype],
        env=builtin_addition.env(), cwd=tmp_path, timeout=800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    steps = steps_of(out)
    assert len(steps) == 20
    gaps = [(r["actor/rollout_log_prob_diff"], r["actor/rollout_log_prob_diff_max"]) for r in steps]
    assert gaps == [(0.0, 0.0)] * 20, gaps
    assert len({r["response/length_mean"] for r in steps}) > 1  # the batches differ


def test_default_numerics_have_the_gap(builtin_addition):
    gaps = [r["actor/rollout_log_prob_diff"] for r in steps_of(builtin_addition.out)]
    assert len(gaps) == 120 and max(gaps) > 0, max(gaps)
