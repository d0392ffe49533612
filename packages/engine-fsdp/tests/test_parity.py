"""2-rank FSDP engines vs a single-process plain PyTorch loop (no drivetrain code), fp32."""

import json
import random

import pytest
import torch

from fsdp_harness import VOCAB, build_tiny_model, single_thread
from launch import launch
from reference import reference_run

STEPS = 3
TOL = 1e-5


def make_data(n: int = 8, seed: int = 1):
    rng = random.Random(seed)
    lengths = [rng.randint(4, 24) for _ in range(n)]
    sequences = [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths]
    masks = [[0] + [int(rng.random() < 0.7) for _ in range(k - 1)] for k in lengths]
    for m in masks:
        m[-1] = 1
    return {"sequences": sequences, "masks": masks, "steps": STEPS}


CASES = [
    {"name": "fsdp2", "engine": "fsdp2", "micro_batch": {"micro_batch_size": 2}},
    {"name": "fsdp2_token_budget", "engine": "fsdp2", "micro_batch": {"max_tokens": 40}},
    {"name": "fsdp2_padded_sdpa", "engine": "fsdp2", "micro_batch": {"micro_batch_size": 3},
     "overrides": {"attention": "sdpa", "remove_padding": False}},
    {"name": "fsdp2_packed_sdpa", "engine": "fsdp2", "micro_batch": {"micro_batch_size": 3},
     "overrides": {"attention": "sdpa"}},
    {"name": "fsdp2_ulysses2", "engine": "fsdp2", "micro_batch": {"micro_batch_size": 4},
     "overrides": {"ulysses_size": 2}},
    {"name": "fsdp1", "engine": "fsdp", "micro_batch": {"micro_batch_size": 2}},
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    single_thread()
    tmp = tmp_path_factory.mktemp("parity")
    model_dir = build_tiny_model(str(tmp / "qwen2"))
    data = make_data()
    reference = reference_run(model_dir, data["sequences"], data["masks"], steps=STEPS)
    out = tmp / "out"
    out.mkdir()
    ranks = launch(
        "worker_parity.py", out, model_dir, json.dumps(data), json.dumps(CASES), timeout=850
    )
    return reference, ranks, out


@pytest.mark.distributed
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [c["name"] for c in CASES])
def test_matches_plain_pytorch(runs, case):
    reference, ranks, out = runs
    for rank in ranks:  # every rank reports the same global numbers
        got = rank[case]
        assert got["losses"] == pytest.approx(reference["losses"], abs=TOL, rel=TOL)
        assert got["grad_norms"] == pytest.approx(reference["grad_norms"], abs=TOL, rel=TOL)
    weights = torch.load(out / f"{case}.pt")
    assert set(weights) == set(reference["weights"])
    for name, value in reference["weights"].items():
        diff = (weights[name] - value).abs().max().item()
        assert diff <= TOL, f"{case}: {name} differs by {diff:.2e} after {STEPS} steps"
