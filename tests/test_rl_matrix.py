"""Every combination of the RL knobs that decide which log-probs a step computes (issue 19,
item 5): KL coefficient 0 / > 0 x KL in the reward or as a loss x the on-policy shortcut on/off x
PPO epochs 1/2 x reference none/engine/adapter x critic off/on. Valid ones run two steps
in-process on a tiny model (fsdp2 engine, HF rollout); invalid ones are refused in one line
when the config is loaded, before anything is built.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from drivetrain.api.errors import ConfigError
from drivetrain.trainer.config_loader import load_config
from drivetrain.trainer.rl.config import RLConfig
from drivetrain.trainer.rl.job import load_rl_job, prepare, start
from drivetrain.trainer.rl.trainer import RLTrainer
from rl_support import make_rl_job

pytestmark = [pytest.mark.fault, pytest.mark.timeout(120)]
KL_COEF = 0.05
STEPS = 2
REFERENCES = ("none", "engine", "adapter")
#: (kl_coef, kl_in_reward, ppo_epochs, reference, critic); each runs with the shortcut on and off
CASES = list(itertools.product((0.0, KL_COEF), (False, True), (1, 2), REFERENCES, (False, True)))
REFUSED = {
    # reference mode and KL coefficient must agree: a reference nothing uses, or a KL term
    # that nothing computes, is a mistake in the config, not a run to start
    (0.0, "engine"): "reference.mode=engine but algorithm.kl.coef is 0: nothing uses it",
    (0.0, "adapter"): "reference.mode=adapter but algorithm.kl.coef is 0: nothing uses it",
    (KL_COEF, "none"): f"algorithm.kl.coef={KL_COEF} needs a reference model",
}


@pytest.fixture(scope="module")
def job_args(tmp_path_factory) -> list[str]:
    base = make_rl_job(tmp_path_factory.mktemp("rl_matrix"), rows=8)
    return [
        *base, "run.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=4",
        "reward.functions=[rl_support:varied_reward]",
    ]  # fmt: skip


def overrides(case: tuple, shortcut: bool) -> list[str]:
    kl_coef, kl_in_reward, epochs, reference, critic = case
    return [
        f"algorithm.kl.coef={kl_coef}", f"algorithm.kl.in_reward={kl_in_reward}",
        f"algorithm.on_policy_shortcut={shortcut}", f"algorithm.ppo_epochs={epochs}",
        f"reference.mode={reference}", f"algorithm.advantage={'gae' if critic else 'grpo'}",
        *(["actor.model.lora.rank=4"] if reference == "adapter" else []),
    ]  # fmt: skip


def run_steps(args: list[str], out: Path) -> list[dict[str, float]]:
    job = load_rl_job("grpo", engine="fsdp2", overrides=[*args, f"run.output_dir={out}"])
    prepared = prepare(job)
    placement = start(prepared)
    try:
        trainer = RLTrainer(prepared.setup, placement)
        return [trainer.step(step) for step in range(STEPS)]
    finally:
        placement.close()


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"kl{c[0]}-inreward{c[1]}-epochs{c[2]}-ref_{c[3]}-critic{c[4]}"
)
def test_rl_step_matrix(case, job_args, tmp_path):
    kl_coef, kl_in_reward, epochs, reference, critic = case
    refused = REFUSED.get((kl_coef, reference))
    if refused is not None:
        for shortcut in (True, False):
            with pytest.raises(ConfigError) as info:
                load_rl_job(
                    "grpo", engine="fsdp2", overrides=[*job_args, *overrides(case, shortcut)]
                )
            message = str(info.value)
            assert refused in message and "\n" not in message, message
        return
    runs = {}
    for shortcut in (True, False):
        runs[shortcut] = run_steps(
            [*job_args, *overrides(case, shortcut)], tmp_path / str(shortcut)
        )
    kl_in_loss = kl_coef > 0 and not kl_in_reward
    for shortcut, steps in runs.items():
        # one update per batch skips the separate old-log-prob forward, unless the KL penalty in
        # the reward needs them before the update
        on_policy = shortcut and epochs == 1 and not (kl_coef > 0 and kl_in_reward)
        for metrics in steps:
            bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
            assert not bad, bad
            assert ("time/old_log_probs_s" in metrics) is not on_policy
            assert ("actor/kl_ref" in metrics) is (kl_coef > 0)
            assert ("actor/kl_loss" in metrics) is kl_in_loss
            assert ("critic/value_loss" in metrics) is critic
            assert metrics["actor/grad_norm"] > 0
        if kl_coef > 0:
            assert steps[0]["actor/kl_ref"] == pytest.approx(0.0, abs=1e-6)  # policy == reference
            assert steps[1]["actor/kl_ref"] > 0  # the first update moved the policy away
    # with the shortcut the KL to the reference is measured in the update's forward, without it
    # from the separate old-log-prob pass: the same quantity
    on, off = runs[True][-1], runs[False][-1]
    for key in ("actor/kl_ref", "actor/kl_loss", "reward/mean", "actor/entropy"):
        if key in off:
            assert on[key] == pytest.approx(off[key], rel=1e-3, abs=1e-7), key


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ([], "none"),
        (["algorithm.kl.coef=0.01"], "engine"),  # `drivetrain grpo algorithm.kl.coef=0.01`
        (["algorithm.kl.coef=0.01", "actor.model.lora.rank=8"], "adapter"),
    ],
)
def test_auto_reference(args, want):
    assert load_config(RLConfig, overrides=args).reference_mode == want


def test_adapter_reference_needs_lora():
    with pytest.raises(ConfigError, match=r"reference.mode=adapter needs a LoRA actor"):
        load_config(RLConfig, overrides=["algorithm.kl.coef=0.01", "reference.mode=adapter"])
