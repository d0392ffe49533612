"""`drivetrain grpo` with generation ahead of training (algorithm.mode), on a tiny model as
users run it: sync unchanged, async with no staleness equal to sync, the scripted schedule
bit-identical across runs, a killed rollout process failing fast and resuming."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

from golden import check_golden
from rl_support import check_async_steps, kill_mid_run, make_rl_job, metrics_rows, run_rl
from sft_support import sft_env

pytestmark = pytest.mark.timeout(600)
TESTS = Path(__file__).resolve().parent
SERVER = "drivetrain.rollout.process.server"  # the rollout server process's module
#: the per-step numbers compared bitwise (JSON floats round-trip exactly)
KEYS = ("reward/mean", "actor/loss", "actor/grad_norm", "actor/entropy", "actor/pg_loss",
        "response/length_mean")  # fmt: skip


def grpo_steps(tmp_path: Path, name: str, *overrides: str) -> list[dict]:
    root = tmp_path / name
    root.mkdir()
    base = make_rl_job(root)
    out = root / "run"
    env = {**sft_env(root), "PYTHONPATH": str(TESTS)}
    run_rl("grpo", *base, f"run.output_dir={out}", "run.steps=5",
           "reward.functions=[rl_support:varied_reward]", *overrides, env=env)  # fmt: skip
    return [r for r in metrics_rows(out) if "reward/mean" in r]


def numbers(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in KEYS} for r in rows]


def test_sync_mode_reproduces_the_loop_before_async(tmp_path):
    """The sync loop is unchanged: the same 5 steps, bit for bit, as before generation ahead
    of training existed (tests/data/grpo_sync_5_steps.json, recorded at 68df895)."""
    golden = json.loads((TESTS / "data" / "grpo_sync_5_steps.json").read_text())["steps"]
    assert numbers(grpo_steps(tmp_path, "sync", "algorithm.mode=sync")) == golden


def test_async_without_staleness_equals_sync(tmp_path):
    """max_staleness=0: a group is admitted only under the weights that train on it, so the
    stream generates the sync loop's batch (a polling thread, not the trainer, drives it)."""
    golden = json.loads((TESTS / "data" / "grpo_sync_5_steps.json").read_text())["steps"]
    rows = grpo_steps(tmp_path, "async0", "algorithm.mode=async", "algorithm.ahead.max_staleness=0")
    assert numbers(rows) == golden
    assert all(r["async/staleness_max"] == 0 for r in rows)


@pytest.mark.fault
def test_the_scripted_schedule_is_bit_identical_across_runs(tmp_path):
    """Async with staleness 1, partial rollouts and TIS, generation advanced 3 token steps
    per training step by the trainer: two runs give the same numbers; samples span two
    versions and the correction ran."""
    overrides = ("algorithm.mode=async", "algorithm.ahead.max_staleness=1",
                 "algorithm.ahead.scripted_rounds=3")  # fmt: skip
    first = grpo_steps(tmp_path, "a", *overrides)
    second = grpo_steps(tmp_path, "b", *overrides)
    assert first == [dict(r, **_timing(s)) for r, s in zip(second, first, strict=True)]
    check_golden("grpo_async_scripted", first, steps=5)
    assert max(r["async/partial_samples_frac"] for r in first) > 0
    assert max(r["async/staleness_max"] for r in first) == 1
    assert all("off_policy/is_weight_mean" in r for r in first)
    # the samples log counts the staleness without the trainer's own metric
    check_async_steps(tmp_path / "a" / "run", first, max_staleness=1)
    assert all(r["async/dropped_samples"] == 0 for r in first)  # nothing dropped
    assert not any("async/dropped_length_mean" in r for r in first)


def test_ppo_with_a_critic_trains_async_within_its_staleness_bound(tmp_path):
    """PPO's critic learns from the same stale samples as the actor: values and GAE of
    samples generated up to one version behind, corrected, within the bound."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    summary, _ = run_rl(
        "ppo", *base, f"run.output_dir={out}", "run.steps=4", "algorithm.mode=async",
        "algorithm.ahead.max_staleness=1", "algorithm.ahead.scripted_rounds=3",
        env=sft_env(tmp_path),
    )  # fmt: skip
    assert summary["steps"] == 4
    rows = [r for r in metrics_rows(out) if "reward/mean" in r]
    check_async_steps(out, rows, max_staleness=1)
    assert max(r["async/staleness_max"] for r in rows) == 1  # it did run ahead
    for row in rows:
        assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
        assert "off_policy/is_weight_mean" in row


def _timing(row: dict) -> dict:
    """The wall-clock entries of a row (they differ run to run)."""
    return {k: v for k, v in row.items() if k.startswith(("time/", "perf/", "weight_sync/"))}


@pytest.mark.slow  # three runs: 40 s
@pytest.mark.serial  # a rollout server and the trainer busy together; a 10 s bound
def test_killed_rollout_process_fails_fast_and_resume_continues(tmp_path):
    """Async GRPO with the rollout in its own process: killing that process ends the run
    within 10 s with a message naming it; --resume auto finishes the run."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    args = [*base, f"run.output_dir={out}", "run.steps=30", "run.save_every=1",
            "algorithm.mode=async", f"rollout.python={sys.executable}"]  # fmt: skip

    def rollout_server(run: int) -> int:
        children = psutil.Process(run).children(recursive=True)
        found = [p.pid for p in children if SERVER in " ".join(p.cmdline())]
        assert len(found) == 1, found
        return found[0]

    elapsed, stderr = kill_mid_run(args, out, sft_env(tmp_path), rollout_server)
    print(f"the run failed {elapsed:.1f} s after the rollout process was killed")
    assert elapsed < 10, stderr[-3000:]
    assert "rollout process" in stderr, stderr[-3000:]
    summary, done = run_rl("grpo", *args, "--resume", "auto", env=sft_env(tmp_path))
    assert "resumed from" in done.stderr and summary["steps"] == 30
    steps = [r["step"] for r in metrics_rows(out) if "reward/mean" in r]
    assert steps[-1] == 30 and sorted(set(steps)) == list(range(1, 31))
