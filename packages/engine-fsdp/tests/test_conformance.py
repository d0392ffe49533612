"""The engine-api conformance kit on fsdp2 and fsdp, at world size 1 (in-process) and 2."""

import json

import pytest

from drivetrain.testing import EngineConformance
from drivetrain.testing.conformance import ENGINE_CHECKS
from fsdp_harness import FSDPHarness, build_tiny_model, single_thread
from launch import launch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny") / "qwen2"))


class TestFSDP2WorldOne(EngineConformance):
    @pytest.fixture(autouse=True)
    def _model(self, model_dir):
        single_thread()
        self.model_dir = model_dir

    def harness(self):
        return FSDPHarness(self.model_dir, engine="fsdp2")


class TestFSDP1WorldOne(TestFSDP2WorldOne):
    def harness(self):
        return FSDPHarness(self.model_dir, engine="fsdp")


CASES = [
    {"engine": "fsdp2"},
    {"engine": "fsdp"},
    {"engine": "fsdp2", "overrides": {"strategy": "shard_grad_op"}},
    {"engine": "fsdp2", "overrides": {"strategy": "no_shard"}},
    {"engine": "fsdp2", "overrides": {"strategy": "hybrid_shard", "hybrid_shard_size": 1}},
    {"engine": "fsdp2", "overrides": {"ulysses_size": 2}},
    {"engine": "fsdp2", "overrides": {"model": {"gradient_checkpointing": True}}},
    {"engine": "fsdp2", "overrides": {"offload": {"params": True, "optimizer": True}}},
    {"engine": "fsdp", "overrides": {"strategy": "shard_grad_op"}},
]


@pytest.mark.slow  # 90 s
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_conformance_world_two(model_dir, tmp_path):
    ranks = launch("worker_conformance.py", tmp_path, model_dir, json.dumps(CASES), timeout=850)
    slowest = sorted(ranks[0], key=lambda r: -r["seconds"])[:8]
    print("slowest checks:", *(f"{r['seconds']:.1f}s {r['check']} {r['case']}" for r in slowest))
    failures = [r for rank in ranks for r in rank if not r["passed"]]
    assert not failures, json.dumps(failures, indent=1)[:4000]
    assert len(ranks[0]) == len(CASES) * len(ENGINE_CHECKS)
