"""`drivetrain grpo` / `drivetrain ppo` on a tiny model: in-process GRPO and PPO with a critic,
colocated and separate Ray placement giving the same first update, a rollout on another node of
a cluster, a lost node and resume."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import psutil
import pytest

from cli_run import run_command
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from golden import check_golden
from ray_cluster import Node, RayCluster
from rl_support import (
    check_async_steps,
    kill_mid_run,
    make_rl_job,
    metrics_rows,
    rl_command,
    run_rl,
)
from sft_support import sft_env

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[1]


def test_grpo_inprocess_with_user_plugins(tmp_path):
    """In-process GRPO with a user's policy loss (registered by a plugin module) and a custom
    reward by dotted path: the examples/ recipes."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    env = {**sft_env(tmp_path), "PYTHONPATH": str(REPO)}
    summary, done = run_rl(
        "grpo", *base, f"run.output_dir={out}", "run.steps=2",
        "algorithm.plugins=[examples.custom_policy_loss]",
        "algorithm.policy_loss=clipped_reinforce",
        "reward.functions=[exact_match,examples.custom_reward:brevity]", env=env,
    )  # fmt: skip
    assert summary["steps"] == 2
    assert summary["weight_digests"] == {}  # in-process: the engine streams into the rollout
    rows = [r for r in metrics_rows(out) if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("actor/grad_norm", "actor/pg_loss", "actor/entropy", "time/generate_s",
                "weight_sync/seconds", "response/length_mean", "perf/tokens_per_s"):  # fmt: skip
        assert key in rows[0], key
    # the rollout generated with exactly the weights the trainer scores with
    assert rows[0]["actor/rollout_log_prob_diff"] < 1e-4
    assert "rollout_log_prob_diff is" not in done.stderr  # the alarm stays quiet
    assert "time/old_log_probs_s" not in rows[0]  # one update per batch: no separate forward
    assert (out / "reward_curve.png").is_file() and (out / "config.yaml").is_file()
    assert "validation before" in done.stderr
    assert "reward/examples.custom_reward:brevity" in rows[0]


SKEWED_ROLLOUT = """
import dataclasses
from drivetrain.api.plugin import PluginSpec
from drivetrain.rollout.hf.rollout import HFRollout

SPEC = PluginSpec(
    name="hf_skewed", factory="skewed_rollout:Skewed",
    config="drivetrain.rollout.config:HFRolloutConfig", api=">=0.1,<0.2",
    capabilities=frozenset({"device:cpu"}), description="hf, log-probs 0.01 off",
)

class Skewed(HFRollout):
    # a third party's rollout whose log-probs are off by a constant 0.01
    def poll(self, timeout_s=0.0):
        return [dataclasses.replace(c, log_probs=tuple(x - 0.01 for x in c.log_probs))
                for c in super().poll(timeout_s)]
"""


def test_the_log_prob_alarm_fires_once_on_a_rollout_off_by_a_constant(tmp_path):
    """A rollout (a plugin, as a third party ships one) whose log-probs are 0.01 off trains
    without failing, but the run says so once, with the step and what to check."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "skewed_rollout.py").write_text(SKEWED_ROLLOUT)
    info = plugins / "skewed_rollout-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: skewed-rollout\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[drivetrain.rollouts]\nhf_skewed = skewed_rollout:SPEC\n"
    )
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    env = {**sft_env(tmp_path), "PYTHONPATH": str(plugins)}
    _, done = run_rl(
        "grpo", *base, "--rollout", "hf_skewed", f"run.output_dir={out}", "run.steps=3",
        env=env,
    )  # fmt: skip
    key = "actor/rollout_log_prob_diff"
    diffs = [r[key] for r in metrics_rows(out) if key in r]
    assert len(diffs) == 3 and all(abs(d - 0.01) < 1e-3 for d in diffs), diffs
    warnings = [line for line in done.stderr.splitlines() if "rollout_log_prob_diff is" in line]
    assert len(warnings) == 1 and "step 1:" in warnings[0], done.stderr[-2000:]
    assert "weight_sync.provenance" in warnings[0]


@pytest.mark.fault
def test_grpo_dapo_preset_samples_until_the_groups_are_informative(tmp_path):
    """``--preset dapo``: dynamic sampling (groups with one reward everywhere replaced),
    overlong shaping in the reward, and the overlong filter on top."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    env = {**sft_env(tmp_path), "PYTHONPATH": str(REPO / "tests")}
    summary, done = run_rl(
        "grpo", "--preset", "dapo", *base, f"run.output_dir={out}", "run.steps=2",
        "sampling.n=2", "reward.functions=[rl_support:varied_reward]",
        "algorithm.dapo.overlong_filter=true", env=env,
    )  # fmt: skip
    assert summary["steps"] == 2
    # the task's own reward beside the shaped total (the penalty can dominate it)
    assert "task reward without the overlong penalty" in done.stderr + done.stdout
    assert summary["task_reward_first_steps_mean"] >= summary["reward_first_steps_mean"]
    rows = [r for r in metrics_rows(out) if "reward/mean" in r]
    check_golden("grpo_dapo_preset", rows, steps=2)
    for row in rows:
        # 4 informative groups of 2 kept, unless the 4-round cap was reached first
        assert row["sampling/kept_groups"] == 4 or row["sampling/rounds"] == 4
        # extra rounds ask only for the groups still missing: 4 + at most 4 per extra round
        assert 4 <= row["sampling/generated_groups"] <= 4 * row["sampling/rounds"]
        assert row["sampling/rounds"] == 1 or row["sampling/generated_groups"] > 4
        assert 0 <= row["sampling/zero_variance_frac"] <= 1
        assert row["reward/overlong"] <= 0  # 6 new tokens, a 20% buffer: a -1 ramp over 1.2
        task = row["reward/rl_support:varied_reward"]  # the one reward function, weight 1
        assert row["reward/task"] == pytest.approx(task, abs=1e-6)
        assert 0 <= row["response/overlong_filtered_frac"] <= 1
    config = (out / "config.yaml").read_text()
    assert "clip:\n    low: 0.2\n    high: 0.28" in config and "dynamic_sampling: true" in config


def test_distill_scores_the_students_tokens_with_the_teacher(tmp_path):
    """`drivetrain distill`: the teacher (here a second copy of the student's model, then a
    differently initialised one) scores every sampled token; its reverse KL is the reward."""
    base = make_rl_job(tmp_path)
    twin = tmp_path / "model"  # the student itself: every token's reverse KL is 0
    run_rl(
        "distill", *base, f"teacher.model_path={twin}", f"run.output_dir={tmp_path / 'same'}",
        "run.steps=1", env=sft_env(tmp_path),
    )  # fmt: skip
    row = metrics_rows(tmp_path / "same")[0]
    assert row["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-5)
    assert row["advantages/abs_mean"] == pytest.approx(0.0, abs=1e-5)
    other = build_tiny_chat_model(tmp_path / "teacher", seed=7)
    out = tmp_path / "other"
    run_rl(
        "distill", *base, f"teacher.model_path={other}", f"run.output_dir={out}", "run.steps=2",
        env=sft_env(tmp_path),
    )  # fmt: skip
    rows = [r for r in metrics_rows(out) if "distill/reverse_kl" in r]
    assert len(rows) == 2 and rows[0]["advantages/abs_mean"] > 0
    check_golden("distill_tiny", rows, steps=2)
    assert "time/teacher_log_probs_s" in rows[0]
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["roles"] == ["actor", "teacher"]


def test_ppo_with_critic_reference_and_reward_model(tmp_path):
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    summary, _ = run_rl(
        "ppo", *base, f"run.output_dir={out}", "run.steps=2", "algorithm.kl.coef=0.05",
        "algorithm.kl.in_reward=true", "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=2",
        f"reward.model_path={tmp_path / 'model'}", env=sft_env(tmp_path),
    )  # fmt: skip
    assert summary["steps"] == 2
    check_golden("ppo_tiny", metrics_rows(out), steps=2)
    row = metrics_rows(out)[0]
    assert row["critic/value_loss"] > 0 and row["critic/grad_norm"] > 0
    assert row["rollout/log_prob_diff"] < 1e-4  # PPO epochs: old log-probs recomputed
    assert "actor/kl_ref" in row and row["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["roles"] == ["actor", "critic", "reference", "reward_model"]
    assert "reward/model_mean" in row  # a value-head engine scored every sample


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.policy_loss=nope"],
         "unknown policy loss 'nope'; registered: cispo, gspo, reinforce, vanilla"),
        (["algorithm.mode=async", "workers.num=2"],  # colocated rollouts sleep while it trains
         "algorithm.mode=async generates while the actor trains"),
    ],
)  # fmt: skip
def test_bad_config_fails_before_any_worker(tmp_path, overrides, message):
    base = make_rl_job(tmp_path)
    done = run_command(
        rl_command("grpo", *base, *overrides, "--dry-run"), env=sft_env(tmp_path), timeout=300
    )
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.slow
@pytest.mark.serial  # Ray: two workers and a rollout replica
def test_colocated_and_separate_give_the_same_first_update(tmp_path):
    """2 actor ranks on Ray + 1 rollout replica: sharing the ranks' bundle (colocated
    transport) or on its own (broadcast): the same rollouts give bitwise the same weights."""
    base = make_rl_job(tmp_path)
    digests = {}
    for mode in ("colocated", "separate"):
        out = tmp_path / mode
        summary, _ = run_rl(
            "grpo", *base, f"run.output_dir={out}", "run.steps=1", "workers.num=2",
            f"placement.mode={mode}", env=sft_env(tmp_path),
        )  # fmt: skip
        digests[mode] = summary["weight_digests"]["1"]
        row = metrics_rows(out)[0]
        assert row["actor/rollout_log_prob_diff"] < 1e-4
    assert digests["colocated"] == digests["separate"]


def placed(stderr: str) -> tuple[list[str], list[str]]:
    """The nodes of the actor's ranks and of the rollouts, from the job's placement line
    (``actor ranks on 1 node(s): 0 ab12cd34 (127.0.0.1), ...; rollouts on ...``)."""
    line = next(x for x in stderr.splitlines() if x.startswith("actor ranks on"))
    ranks, rollouts = line.split("; ")
    return [
        [entry.split(" ")[1] for entry in part.split(": ", 1)[1].split(", ")]
        for part in (ranks, rollouts)
    ]


@pytest.mark.slow
@pytest.mark.serial  # a Ray cluster of three nodes: two workers and a rollout replica
def test_async_grpo_with_the_rollout_on_another_node(tmp_path):
    """2 actor ranks on one node of a cluster (2 CPUs), the rollout replica on another (1 CPU),
    generating ahead of training: the weights cross the nodes over the broadcast transport
    (never shared memory); every trained sample at most one version behind, tagged with its
    versions, the replica updated each step."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    with RayCluster(sft_env(tmp_path)) as cluster:
        cluster.add_node(cpus=2)
        cluster.add_node(cpus=1)
        summary, done = run_rl(
            "grpo", *base, f"run.output_dir={out}", "run.steps=3", "workers.num=2",
            "placement.mode=separate", "algorithm.mode=async", "algorithm.ahead.max_staleness=1",
            f"workers.ray_address={cluster.address}", env=sft_env(tmp_path),
        )  # fmt: skip
    ranks, rollouts = placed(done.stderr)
    assert len(set(ranks)) == 1 and rollouts[0] not in ranks, (ranks, rollouts)
    assert "weights via broadcast" in done.stderr
    assert summary["steps"] == 3
    rows = [r for r in metrics_rows(out) if "reward/mean" in r]
    check_async_steps(out, rows, max_staleness=1)
    # the replica took each step's weights (over the broadcast transport: it is elsewhere)
    assert [r["weight_sync/version"] for r in rows] == [1, 2, 3]
    assert all(
        r["actor/rollout_log_prob_diff"] < 1e-4 for r in rows if r["async/staleness_max"] == 0
    )


def node_of_rank_1(nodes: list[Node]) -> Node:
    """The node whose processes include a rank's actor (the second one found)."""
    hosting = []
    for node in nodes:
        for child in psutil.Process(node.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if " ".join(child.cmdline()).startswith("ray::RankActor"):
                    hosting.append(node)
    assert len(hosting) == 2, [n.name for n in hosting]
    return hosting[1]


@pytest.mark.slow
@pytest.mark.serial  # a Ray cluster of four nodes, one of them killed
def test_a_lost_node_fails_the_run_fast_and_resume_continues_on_the_rest(tmp_path):
    """Colocated GRPO with its two ranks on two of three one-CPU nodes: the raylet of rank 1's
    node is killed (its machine is gone) after step 2's checkpoint; the run stops in one line
    within its deadline, and `--resume auto` on the two nodes left continues to the end from
    an untorn checkpoint."""
    base = make_rl_job(tmp_path)
    out = tmp_path / "run"
    env = sft_env(tmp_path)
    with RayCluster(env) as cluster:
        nodes = [cluster.add_node(cpus=1) for _ in range(3)]
        args = [*base, f"run.output_dir={out}", "run.steps=20", "run.save_every=1",
                "workers.num=2", f"workers.ray_address={cluster.address}"]  # fmt: skip
        lost: list[Node] = []

        def raylet_of_rank_1(run: int) -> int:
            lost.append(node_of_rank_1(nodes))
            return lost[0].raylet_pid()

        elapsed, stderr = kill_mid_run(args, out, env, raylet_of_rank_1)
        print(f"the run failed {elapsed:.1f} s after {lost[0].name}'s raylet was killed")
        assert elapsed < 120
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "a Ray worker died" in errors[0], stderr[-3000:]
        summary, done = run_rl("grpo", *args, "--resume", "auto", env=env)
    assert "resumed from" in done.stderr and summary["steps"] == 20
    assert "skipping checkpoint" not in done.stderr  # nothing the lost node wrote is torn
    before, after = placed(stderr)[0], placed(done.stderr)[0]
    # two nodes each time; the one lost is gone, the third took its place
    assert len(set(before)) == len(set(after)) == 2 and len(set(before) & set(after)) == 1
    steps = [r["step"] for r in metrics_rows(out) if "reward/mean" in r]
    assert steps == list(range(1, 21))
