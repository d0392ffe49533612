"""Checkpoint resume (same world size: bit for bit; world size 1: within 1e-5) and HF export."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from drivetrain.engine.fsdp.checkpoint import is_complete
from fsdp_harness import build_tiny_model, build_tiny_tokenizer, single_thread
from launch import launch
from test_parity import make_data


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    single_thread()
    tmp = tmp_path_factory.mktemp("resume")
    model_dir = build_tiny_model(str(tmp / "model"))
    build_tiny_tokenizer(model_dir)
    data = json.dumps(make_data())
    ckpt = str(tmp / "ckpt")
    (tmp / "train").mkdir()
    train = launch("worker_resume.py", tmp / "train", model_dir, data, "train", ckpt)
    return tmp, model_dir, data, ckpt, train


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_resume_same_world_size_is_bit_exact(trained):
    tmp, model_dir, data, ckpt, train = trained
    assert is_complete(ckpt)
    (tmp / "resume2").mkdir()
    resumed = launch("worker_resume.py", tmp / "resume2", model_dir, data, "resume", ckpt)
    for rank_train, rank_resumed in zip(train, resumed, strict=True):
        assert rank_resumed["loaded_step"] == 1
        assert rank_resumed["losses"] == rank_train["losses"][1:]  # exact equality
        assert rank_resumed["norms"] == rank_train["norms"][1:]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_resume_at_world_size_one(trained):
    tmp, model_dir, data, ckpt, train = trained
    (tmp / "resume1").mkdir()
    [resumed] = launch(
        "worker_resume.py", tmp / "resume1", model_dir, data, "resume", ckpt, nproc=1
    )
    assert resumed["losses"] == pytest.approx(train[0]["losses"][1:], abs=1e-5, rel=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_hf_export_reloads_with_identical_outputs(trained):
    tmp, *_ = trained
    export = tmp / "train" / "hf"
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.convert_tokens_to_ids("w5") == 5
    engine_log_probs = torch.load(tmp / "train" / "engine_log_probs.pt")
    data = make_data()
    for i, seq in enumerate(data["sequences"]):
        ids = torch.tensor(seq)[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        ref = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        got = engine_log_probs[i, 1 : len(seq)]
        assert (got - ref).abs().max().item() < 1e-5
