"""Mixture-of-experts on 2 CPU ranks (gloo): HF <-> Megatron logits parity and exact export
round trip for Qwen2-MoE (shared expert, un-normalised top-k), Qwen3-MoE (renormalised top-k,
q/k norm) and Mixtral at EP=2, TP=2 (experts split over TP), TP=2 x EP=2 (experts whole, spread
over the TP ranks) and PP=2; then the engine trains a Qwen2-MoE for 3 steps at EP=2, TP=2 (+SP) and
TP=2 x EP=2, and matches HF's loss, gradient norm and AdamW trajectory.

One launch serves all parity checks and one all training checks (importing megatron-core costs
~6 s a process).
"""

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from megatron_harness import VOCAB
from megatron_launch import launch
from parity_data import training_batch

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-5
TOKENS = [[1, 5, 9, 33, 2, 7, 99, 45, 12, 3, 60, 8], [4, 4, 17, 88, 23, 0, 31, 64, 2, 11, 90, 5]]
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=100, intermediate_size=96, max_position_embeddings=128,
             num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
CASES = {
    "qwen2_moe": (Qwen2MoeConfig, {"num_experts": 4, "moe_intermediate_size": 32,
                                   "shared_expert_intermediate_size": 48}),
    "qwen3_moe": (Qwen3MoeConfig, {"num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16,
                                   "norm_topk_prob": True}),
    "mixtral": (MixtralConfig, {"num_local_experts": 4}),
}  # fmt: skip
LAYOUTS = [
    {"name": "ep2", "tp": 1, "pp": 1, "vp": None, "ep": 2},
    # megatron-core refuses MoE + TP without sequence parallel
    {"name": "tp2", "tp": 2, "pp": 1, "vp": None, "sp": True},
    {"name": "tp2ep2", "tp": 2, "pp": 1, "vp": None, "ep": 2, "etp": 1, "sp": True},
    {"name": "pp2", "tp": 1, "pp": 2, "vp": None},
]
CHECKS = [(layout["name"], case) for layout in LAYOUTS for case in CASES]


def _randomise(model):
    with torch.no_grad():  # far from init: norms away from 1, distinct routing per token
        for param in model.parameters():
            param.normal_(0, 0.1) if param.dim() > 1 else param.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (checkpoint dir, HF reference logits, HF state dict)."""
    root = tmp_path_factory.mktemp("hf-moe")
    torch.manual_seed(0)
    out = {}
    for name, (config_cls, extra) in CASES.items():
        model = AutoModelForCausalLM.from_config(config_cls(**SHAPE, **extra), dtype=torch.float32)
        _randomise(model)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor(TOKENS)).logits
        model.save_pretrained(root / name)
        out[name] = (str(root / name), logits, model.state_dict())
    return out


@pytest.fixture(scope="module")
def parity(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe-parity")
    spec = {"layouts": LAYOUTS, "tokens": TOKENS, "cases": [
        {"name": name, "hf_dir": models[name][0]} for name in CASES]}  # fmt: skip
    return launch("worker_model_parity.py", out, json.dumps(spec), timeout=600), out


@pytest.mark.parametrize(("layout", "case"), CHECKS)
def test_moe_logits_match_hf(models, parity, layout, case):
    ranks, _ = parity
    reference = models[case][1]
    holders = [r[f"{layout}-{case}"]["logits"] for r in ranks]
    holders = [h for h in holders if h is not None]
    assert len(holders) == (1 if layout == "pp2" else 2)
    for logits in holders:
        diff = (logits - reference).abs().max().item()
        print(f"{layout} {case}: max |logits diff| = {diff:.2e}")
        assert diff < TOL


@pytest.mark.parametrize(("layout", "case"), CHECKS)
def test_moe_export_round_trip_exact(models, parity, layout, case):
    ranks, out = parity
    digests = [r[f"{layout}-{case}"]["digest"] for r in ranks]
    assert digests[0] == digests[1], "ranks saw different export streams"
    original = models[case][2]
    assert sorted(n for n, _, _ in digests[0]) == sorted(original)
    reloaded = AutoModelForCausalLM.from_pretrained(out / f"{layout}-{case}").state_dict()
    for name, tensor in original.items():
        assert torch.equal(reloaded[name], tensor), name


# --------------------------------------------------------------------------- training

TRAIN_LAYOUTS = {
    "ep2": {"expert_parallel": 2},
    "tp2": {"tensor_parallel": 2, "sequence_parallel": True},
    "tp2ep2": {"tensor_parallel": 2, "sequence_parallel": True, "expert_parallel": 2,
               "expert_tensor_parallel": 1},
}  # fmt: skip
LR, EPS = 1e-2, 1e-4  # the harness's optimizer (AdamW, no weight decay, no clipping)


def _hf_reference(model_dir, steps=3):
    """HF model, full batch: token-mean NLL over the loss mask, grad norm, AdamW steps."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    sequences, masks = training_batch()
    out = []
    for _ in range(steps):
        optimizer.zero_grad()
        nll_sum, count = 0.0, sum(sum(m) for m in masks)
        for seq, mask in zip(sequences, masks, strict=True):
            logits = model(torch.tensor([seq])).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(seq[1:])[:, None])
            nll_sum = nll_sum - (logp[:, 0] * torch.tensor(mask[1:], dtype=torch.float32)).sum()
        loss = nll_sum / count
        loss.backward()
        norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
        )
        optimizer.step()
        out.append({"loss": float(loss), "grad_norm": float(norm)})
    return out


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-train")
    config = Qwen2MoeConfig(**{**SHAPE, "vocab_size": VOCAB}, **CASES["qwen2_moe"][1])
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model)
    model.save_pretrained(root / "qwen2_moe")
    cases = [{"overrides": o, "run": ["steps"]} for o in TRAIN_LAYOUTS.values()]
    ranks = launch("worker_engine.py", root, str(root / "qwen2_moe"), json.dumps(cases),
                   timeout=600)  # fmt: skip
    return ranks[0], _hf_reference(root / "qwen2_moe")


@pytest.mark.parametrize("layout", list(TRAIN_LAYOUTS))
def test_moe_training_matches_hf(training, layout):
    results, reference = training
    (steps,) = [r["result"] for r in results if r["case"]["overrides"] == TRAIN_LAYOUTS[layout]]
    print(f"{layout}: megatron {steps}\n      hf {reference}")
    assert steps[0]["loss"] == pytest.approx(reference[0]["loss"], abs=1e-5)
    assert steps[0]["grad_norm"] == pytest.approx(reference[0]["grad_norm"], rel=1e-4)
    for got, want in zip(steps, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-4)
