"""``drivetrain diagnose mismatch`` names the place of each planted fault between an engine
(fsdp2) and an ``hf`` rollout: a perturbed layer in the rollout's copy, a bucket that never
arrived, weights rounded through another dtype, one op of the rollout's forward computing
something else; a healthy pair agrees (the CLI exits 0), in exact numerics on every op."""

from __future__ import annotations

import pytest
import torch

from cli_run import run_cli
from drivetrain.api import ModelConfig, Prompt, SamplingParams
from drivetrain.api.registry import engines, rollouts
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.trainer.diagnose import diagnose
from rollout_support import CHAT_PROMPTS, build_model, fsdp_engine, train_step

pytestmark = pytest.mark.timeout(300)
PROMPTS = [Prompt(token_ids=(5, 9, 14)), Prompt(token_ids=(7, 3, 11, 2))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A model directory and an engine one step away from it (so stale weights show)."""
    torch.set_num_threads(1)
    model_dir = build_model(tmp_path_factory.mktemp("diagnose") / "model")
    engine = fsdp_engine(model_dir)
    rollout = hf(model_dir)
    sampled = SamplingParams(temperature=0.8, max_new_tokens=8, n=2, seed=1)
    train_step(engine, rollout.generate(CHAT_PROMPTS, sampled))
    rollout.shutdown()
    return model_dir, engine


def hf(model_dir):
    return rollouts.load("hf")(HFRolloutConfig(model_path=str(model_dir), max_model_len=128))


def names(engine):
    with engine.eval_mode():
        return [name for name, _ in engine.export_weights()]


def synced(model_dir, engine, stream=lambda weights: weights):
    rollout = hf(model_dir)
    with engine.eval_mode():
        rollout.update_weights(stream(engine.export_weights()), version=1)
    return rollout


def first(found):
    return found.first_divergence.name, found.first_divergence.detail


def test_a_healthy_sync_agrees_at_every_stage(trained):
    model_dir, engine = trained
    found = diagnose(engine, synced(model_dir, engine), PROMPTS)
    assert found.first_divergence is None, found.summary()
    assert [s.agrees for s in found.stages] == [True, True, True]
    assert found.stages[2].name == "ops" and "ops" in found.stages[2].detail


def test_a_perturbed_layer_in_the_rollouts_copy_is_named(trained):
    model_dir, engine = trained
    rollout = synced(model_dir, engine)
    layer = "model.layers.1.mlp.up_proj.weight"
    with torch.no_grad():
        rollout.model.get_parameter(layer).add_(0.05)
    found = diagnose(engine, rollout, PROMPTS)
    stage, detail = first(found)
    assert stage == "weights" and repr(layer) in detail
    assert found.stages[1].agrees is False  # and it reaches the log-probs


def test_a_bucket_that_never_arrived_is_named(trained):
    model_dir, engine = trained
    lost = names(engine)[4:8]  # the rollout keeps its old values of these

    def without_a_bucket(weights):
        return (item for item in weights if item[0] not in lost)

    stage, detail = first(diagnose(engine, synced(model_dir, engine, without_a_bucket), PROMPTS))
    assert stage == "weights" and repr(lost[0]) in detail


def test_weights_rounded_through_another_dtype_are_named(trained):
    model_dir, engine = trained

    def through_bf16(weights):
        return ((n, t.to(torch.bfloat16).to(t.dtype)) for n, t in weights)

    stage, detail = first(diagnose(engine, synced(model_dir, engine, through_bf16), PROMPTS))
    assert stage == "weights" and repr(names(engine)[0]) in detail


def test_the_command_reports_each_stage_and_exits_by_the_verdict(trained):
    model_dir, _ = trained
    cmd = ["diagnose", "mismatch", str(model_dir)]
    done = run_cli(*cmd, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "weights        agrees" in out and "agree at every stage checked" in out
    other = build_model(model_dir.parent / "other", seed=1)  # another checkpoint, as served
    done = run_cli(*cmd, "--rollout-model", str(other), timeout=240)
    assert done.returncode == 1 and "first divergence: weights: tensor" in done.stdout + done.stderr


def planted(rollout, op: str, shift: float) -> None:
    """One op of the rollout's model computes something else: ``shift`` added to its output."""
    module = rollout.model.get_submodule(op)
    module.register_forward_hook(lambda _m, _args, out: out + shift)


@pytest.mark.parametrize("numerics", ["exact", "default"])
def test_a_planted_one_op_difference_is_named(tmp_path, numerics):
    """The weights agree; one op of the rollout's forward (layer 1's activation) is shifted.
    In exact mode every op before it agrees bit for bit, so it is the first to differ; in
    default numerics the earlier ops differ by rounding only, and it is the first beyond the
    tolerance."""
    model_dir = build_model(tmp_path / "model")
    config_cls = engines.load_config_class("fsdp2", object)
    engine = engines.load("fsdp2")(
        config_cls(model=ModelConfig(path=str(model_dir)), device="cpu", numerics=numerics)
    )
    engine.initialize()
    rollout = rollouts.load("hf")(
        HFRolloutConfig(model_path=str(model_dir), max_model_len=128, numerics=numerics)
    )
    try:
        op = "model.layers.1.mlp.act_fn"
        planted(rollout, op, 0.05)
        found = diagnose(engine, rollout, PROMPTS)
        weights, _, ops = found.stages
        assert weights.agrees is True and ops.agrees is False, ops.detail
        assert f"first beyond tolerance 0.002: {op} (" in ops.detail, ops.detail
        if numerics == "exact":
            assert f"first to differ: {op} (" in ops.detail, ops.detail
            assert "layer 1: mlp.act_fn 5.00e-02" in ops.detail
            assert "layer 0:" not in ops.detail  # layer 0 agrees bit for bit
    finally:
        rollout.shutdown()
        engine.close()


def test_exact_sides_agree_on_every_op(tmp_path):
    model_dir = build_model(tmp_path / "model")
    done = run_cli("diagnose", "mismatch", str(model_dir), "--numerics", "exact", timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    out = done.stdout + done.stderr
    assert "ops            agrees       all" in out and "ops equal bit for bit" in out
