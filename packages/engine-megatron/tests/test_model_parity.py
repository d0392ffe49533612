"""HF <-> Megatron: logits parity and exact export round trip, 2 CPU ranks at TP=2 and PP=2.

Tiny random-weight fp32 models (Llama untied and tied, Qwen2 with qkv bias, Qwen3 with q/k
norm, and a Qwen2 value head) are loaded with ``convert.load_hf_weights``, run through
megatron-core's pipeline schedule, and exported with ``convert.export_hf_weights``. One
2-process launch per layout serves every check (importing megatron-core costs ~6 s a process);
the PP launch also runs virtual pipeline (PP=2 x VP=2, one layer per chunk).
"""

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
)

from megatron_launch import launch

TOL = 1e-5
TOKENS = [[1, 5, 9, 33, 2, 7, 99, 45, 12, 3, 60, 8], [4, 4, 17, 88, 23, 0, 31, 64, 2, 11, 90, 5]]
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             vocab_size=100, intermediate_size=96, max_position_embeddings=128)  # fmt: skip
CASES = {
    "llama": (LlamaConfig, {"tie_word_embeddings": False}, False),
    "llama_tied": (LlamaConfig, {"tie_word_embeddings": True}, False),
    "llama3_rope": (LlamaConfig, {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}, False),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": False}, False),
    "qwen3": (Qwen3Config, {"head_dim": 16, "tie_word_embeddings": False}, False),
    "qwen2_value": (Qwen2Config, {"num_labels": 1}, True),
}  # fmt: skip
LAYOUTS = {
    "tp2": [{"name": "tp2", "tp": 2, "pp": 1, "vp": None}],
    "pp2": [{"name": "pp2", "tp": 1, "pp": 2, "vp": None},
            {"name": "pp2vp2", "tp": 1, "pp": 2, "vp": 2}],
}  # fmt: skip
CHECKS = [(group, layout["name"], case) for group, layouts in LAYOUTS.items()
          for layout in layouts for case in CASES]  # fmt: skip


def _auto(value_head):
    return AutoModelForTokenClassification if value_head else AutoModelForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint dir, HF reference logits, HF state dict)."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {}
    for name, (config_cls, extra, value_head) in CASES.items():
        model = _auto(value_head).from_config(config_cls(**SHAPE, **extra), dtype=torch.float32)
        with torch.no_grad():  # far from init: norms and biases away from 1 and 0
            for param in model.parameters():
                param.normal_(0, 0.1) if param.dim() > 1 else param.uniform_(0.5, 1.5)
            model.eval()
            logits = model(torch.tensor(TOKENS)).logits
        model.save_pretrained(root / name)
        out[name] = (str(root / name), logits, model.state_dict())
    return out


@pytest.fixture(scope="module")
def runs(models, tmp_path_factory):
    cache = {}

    def get(group):
        if group not in cache:
            out = tmp_path_factory.mktemp(group)
            spec = {"layouts": LAYOUTS[group], "tokens": TOKENS, "cases": [
                {"name": name, "hf_dir": models[name][0], "value_head": CASES[name][2]}
                for name in CASES]}  # fmt: skip
            cache[group] = (launch("worker_model_parity.py", out, json.dumps(spec), timeout=240),
                            out)  # fmt: skip
        return cache[group]

    return get


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("group", "layout", "case"), CHECKS)
def test_logits_match_hf(models, runs, group, layout, case):
    ranks, _ = runs(group)
    reference = models[case][1]
    got = [r[f"{layout}-{case}"]["logits"] for r in ranks]
    holders = [g for g in got if g is not None]  # the last pipeline stage
    assert len(holders) == (2 if layout == "tp2" else 1)
    for logits in holders:
        assert logits.shape == reference.shape
        diff = (logits - reference).abs().max().item()
        print(f"{layout} {case}: max |logits diff| = {diff:.2e}")
        assert diff < TOL


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("group", "layout", "case"), CHECKS)
def test_export_round_trip_exact(models, runs, group, layout, case):
    ranks, out = runs(group)
    digests = [r[f"{layout}-{case}"]["digest"] for r in ranks]
    assert digests[0] == digests[1], "ranks saw different export streams"
    names = [name for name, _, _ in digests[0]]
    assert len(names) == len(set(names)), "a tensor was exported twice"
    original = models[case][2]
    reloaded = _auto(CASES[case][2]).from_pretrained(out / f"{layout}-{case}").state_dict()
    assert list(reloaded) == list(original)
    for name, tensor in original.items():
        assert torch.equal(reloaded[name], tensor), name
