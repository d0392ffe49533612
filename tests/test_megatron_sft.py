"""``drivetrain sft --engine megatron`` on 2 ranks (torchrun, TP=2 and PP=2): the same loss
curve as the fsdp2 engine in one process, and an HF export that transformers loads."""

import pytest
import torch

from sft_support import make_job, run_sft, train_losses

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron-sft")
    base = make_job(root)
    run_sft(root, root / "fsdp", *base)
    return root, base, train_losses(root / "fsdp")


@pytest.mark.slow  # two 2-rank megatron runs and the fsdp reference: 26-37 s each
@pytest.mark.parametrize("layout", ["engine.tensor_parallel=2", "engine.pipeline_parallel=2"])
def test_megatron_sft_on_two_ranks_matches_fsdp(job, layout):
    from transformers import AutoModelForCausalLM

    root, base, reference = job
    out = root / layout.split(".")[1]
    base = [arg for arg in base if arg != "run.export_hf=false"]
    run_sft(root, out, "--engine", "megatron", layout, *base, nproc=2, timeout=800)
    curve = train_losses(out)
    print(layout, "megatron", curve, "fsdp", reference)
    assert list(curve) == list(reference)
    for step, loss in reference.items():
        assert curve[step] == pytest.approx(loss, abs=1e-4), (step, curve, reference)
    model = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    assert model.config.num_hidden_layers == 2
