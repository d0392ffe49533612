"""The megatron_fsdp engine on 2 CPU processes (gloo): the engine-api conformance kit per
sharding strategy, 3-step parity with engine-megatron (same TP/PP) and engine-fsdp, and a
virtual-pipeline run whose exported weights equal the optimizer's gathered main weights in
every chunk."""

import json
from pathlib import Path

import pytest

from drivetrain.testing.conformance import ENGINE_CHECKS
from megatron_harness import build_tiny_model
from megatron_launch import launch

pytestmark = [pytest.mark.distributed]

STRATEGIES = ["optim_grads_params", "optim_grads", "optim"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "llama"), family="llama")


def _run(model_dir, out, cases, timeout):
    worker = str(Path(__file__).parent / "worker_fsdp.py")  # the launcher runs its own folder's
    return launch(worker, out, model_dir, json.dumps(cases), timeout=timeout)[0]


def _assert_conformance(entry):
    failures = [c for c in entry["result"] if not c["passed"]]
    assert not failures, json.dumps(failures, indent=1)[:4000]
    assert len(entry["result"]) == len(ENGINE_CHECKS)
    return {c["check"]: c for c in entry["result"]}


@pytest.mark.slow  # a minute
@pytest.mark.timeout(600)
def test_conformance_default_strategy_and_parity_with_megatron(model_dir, tmp_path):
    """optim_grads_params at DP=2: the kit, and the same 3 steps as engine-megatron's DDP."""
    cases = [
        {"overrides": {}, "run": ["conformance", "steps"]},
        {"engine": "megatron", "overrides": {}, "run": ["steps"]},
    ]
    results = _run(model_dir, tmp_path, cases, timeout=550)
    _assert_conformance(results[0])
    ours, theirs = results[1]["result"], results[2]["result"]
    for a, b in zip(ours, theirs, strict=True):
        print("megatron_fsdp", a, "megatron", b)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_conformance_other_strategies(model_dir, tmp_path, strategy):
    results = _run(model_dir, tmp_path, [{"overrides": {"sharding_strategy": strategy},
                                          "run": ["conformance"]}], timeout=850)  # fmt: skip
    _assert_conformance(results[0])


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [{"tensor_parallel": 2}, {"pipeline_parallel": 2}])
def test_parity_with_megatron_at_tp2_and_pp2(tmp_path, layout):
    untied = build_tiny_model(str(tmp_path / "llama"), family="llama", tie=False)
    cases = [{"overrides": layout, "run": ["steps"]},
             {"engine": "megatron", "overrides": layout, "run": ["steps"]}]  # fmt: skip
    results = _run(untied, tmp_path, cases, timeout=850)
    for a, b in zip(results[0]["result"], results[1]["result"], strict=True):
        print(layout, "megatron_fsdp", a, "megatron", b)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_chunk_exports_its_trained_weights(tmp_path):
    """PP=2 x VP=2 (two chunks per rank): after a step, the HF export equals the export of the
    optimizer's gathered main weights for every chunk's layers."""
    untied = build_tiny_model(str(tmp_path / "llama"), family="llama", tie=False)
    cases = [{"overrides": {"pipeline_parallel": 2, "virtual_pipeline": 2}, "run": ["chunks"]}]
    diffs = _run(untied, tmp_path, cases, timeout=550)[0]["result"]
    assert {f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)} <= set(diffs)
    assert max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}


@pytest.mark.timeout(600)
def test_resume_is_exact_and_loads_at_another_layout(tmp_path):
    """3 steps uninterrupted == 2 steps + checkpoint + load into a fresh engine + 1 step (DP=2),
    also when loaded at PP=2 (DP=1); loading at another TP size is refused."""
    untied = build_tiny_model(str(tmp_path / "llama"), family="llama", tie=False)
    ckpt = tmp_path / "ckpt"
    cases = [
        {"overrides": {}, "run": ["fresh3", f"save2:{ckpt}", f"load1:{ckpt}"]},
        {"overrides": {"pipeline_parallel": 2}, "run": [f"load1:{ckpt}"]},
        {"overrides": {"tensor_parallel": 2}, "run": [f"refuse:{ckpt}"]},
    ]
    fresh, _, *loads, refused = [r["result"] for r in _run(untied, tmp_path, cases, 550)]
    for loaded in loads:
        assert loaded["steps"][0]["loss"] == pytest.approx(fresh["steps"][2]["loss"], abs=1e-6)
        worst = max(float((loaded["weights"][n] - t).abs().max())
                    for n, t in fresh["weights"].items())  # fmt: skip
        print("resumed vs uninterrupted, max |weight diff|:", worst, loaded["steps"])
        assert worst <= 1e-6
        assert set(loaded["weights"]) == set(fresh["weights"])
    assert "tensor_parallel=2" in refused, refused
