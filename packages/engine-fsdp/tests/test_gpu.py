"""CUDA paths: NCCL process group, FSDP2 mixed precision, fused AdamW, CPUOffloadPolicy with
pinned memory, offload between phases. Skipped without a GPU (CI has none); run on a GPU
machine with `pytest -m gpu packages/engine-fsdp`."""

import pytest
import torch

from drivetrain.api import MicroBatchConfig, OutputSpec
from drivetrain.testing import run_conformance, token_mean_nll
from drivetrain.testing.torch_engines.kit_harness import padded_batch
from fsdp_harness import FSDPHarness, build_tiny_model
from test_parity import make_data

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.mark.parametrize(
    ("engine", "overrides", "tol"),
    [
        ("fsdp2", {}, 1e-5),
        ("fsdp2", {"model": {"dtype": "bfloat16"}}, 3e-2),
        ("fsdp2", {"cpu_offload_policy": True}, 1e-5),
        ("fsdp", {}, 1e-5),
        ("fsdp", {"model": {"dtype": "bfloat16"}}, 3e-2),
    ],
)
def test_conformance_on_cuda(model_dir, engine, overrides, tol):
    harness = FSDPHarness(
        model_dir, engine=engine, overrides=overrides, device="cuda", atol=tol, rtol=tol
    )
    failed = {r.name: r.error for r in run_conformance(harness) if not r.passed}
    assert not failed, failed


def test_mixed_precision_tracks_fp32(model_dir):
    data = make_data()
    batch = padded_batch(data["sequences"], data["masks"])
    losses = {}
    for dtype in ("float32", "bfloat16"):
        harness = FSDPHarness(model_dir, overrides={"model": {"dtype": dtype}}, device="cuda")
        engine = harness.make_engine(MicroBatchConfig(micro_batch_size=4))
        assert engine.device.type == "cuda"
        run = []
        for _ in range(3):
            with engine.train_mode():
                engine.optimizer_zero_grad()
                run.append(engine.forward_backward(batch, token_mean_nll).loss)
                engine.optimizer_step()
        losses[dtype] = run
        exported = dict(engine.export_weights())
        assert all(t.dtype == getattr(torch, dtype) for t in exported.values())
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=2e-2)


def test_offload_between_phases_on_cuda(model_dir):
    data = make_data()
    batch = padded_batch(data["sequences"], data["masks"])
    harness = FSDPHarness(
        model_dir, overrides={"offload": {"params": True, "optimizer": True}}, device="cuda"
    )
    engine = harness.make_engine(MicroBatchConfig(micro_batch_size=4))
    assert all(p.device.type == "cpu" for p in engine._inner.parameters())
    with engine.train_mode():
        assert all(p.device.type == "cuda" for p in engine._inner.parameters())
        engine.optimizer_zero_grad()
        engine.forward_backward(batch, token_mean_nll)
        engine.optimizer_step()
    assert all(p.device.type == "cpu" for p in engine._inner.parameters())
    state = [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert state and all(t.device.type == "cpu" for t in state)
    with engine.eval_mode():
        out = engine.infer(batch, OutputSpec(log_probs=True))
    assert out["log_probs"].device.type == "cpu" and torch.isfinite(out["log_probs"]).all()


@pytest.mark.parametrize("engine_name", ["fsdp2", "fsdp"])
def test_offload_frees_device_memory(tmp_path, engine_name):
    """Wrapped engines (bf16 forces FSDP at world size 1) hand device memory back when idle."""
    model_dir = build_tiny_model(str(tmp_path / "model"), hidden=1024)  # ~19M parameters
    data = make_data()
    batch = padded_batch(data["sequences"], data["masks"])
    overrides = {"model": {"dtype": "bfloat16"}, "offload": {"params": True, "optimizer": True}}
    harness = FSDPHarness(model_dir, engine=engine_name, overrides=overrides, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    engine = harness.make_engine(MicroBatchConfig(micro_batch_size=4))
    with engine.train_mode():
        engine.optimizer_zero_grad()
        engine.forward_backward(batch, token_mean_nll)
        engine.optimizer_step()
        engine.optimizer_zero_grad()
        resident = torch.cuda.memory_allocated() - base
    idle = torch.cuda.memory_allocated() - base
    assert resident > 200e6, (
        f"{engine_name}: expected params + Adam state on the GPU, got {resident}"
    )
    # FSDP1 keeps some mixed-precision/communication buffers of its own on the device
    bound = resident / 10 if engine_name == "fsdp2" else resident / 2
    assert idle < bound, f"{engine_name}: {idle} of {resident} bytes stay on the GPU"
    count = sum(t.numel() for _, t in engine.export_weights())  # works while offloaded
    assert count > 15e6 and torch.cuda.memory_allocated() - base < bound  # and offloads again
