"""Delta updates and provenance through the real weight path: a transformers model's weights
into an ``hf`` rollout over the colocated transport (shared memory, several buckets), driven by
the sync manager. An unchanged model moves nothing, frozen tensors never travel, a failed sync
makes the next one send everything, and a receiver that silently loses a bucket fails the same
sync, naming the rollout, the version and the first tensor it lacks."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from drivetrain.api import Prompt, SamplingParams
from drivetrain.api.registry import ckpt_engines, rollouts
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.ckpt import buckets
from drivetrain.ckpt.config import ColocatedConfig
from drivetrain.rollout.config import HFRolloutConfig
from drivetrain.runtime.weight_ledger import WeightLedger
from drivetrain.trainer.rl.sync_manager import WeightSyncManager, connect_transport, engine_sender
from rollout_support import build_model

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [Prompt(token_ids=(5, 9, 14)), Prompt(token_ids=(7, 3))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_model(tmp_path_factory.mktemp("delta") / "model")


class WeightPath:
    """A trainer-side model, an ``hf`` rollout and the manager between them."""

    def __init__(self, model_dir, *, delta=True, provenance=True) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = HFRolloutConfig(model_path=str(model_dir), max_model_len=128, dtype="float32")
        self.rollout = rollouts.load("hf")(config)
        self.sender = ckpt_engines.load("colocated")(
            ColocatedConfig(bucket_bytes=64 << 10, device="cpu", timeout_s=20)
        )
        receivers = connect_transport(self.sender, "colocated", [self.rollout])
        export = lambda: self.model.state_dict().items()  # noqa: E731
        sender = engine_sender(export, self.sender, WeightLedger(delta=delta))
        self.manager = WeightSyncManager(sender, [self.rollout], receivers, provenance=provenance)
        self.total = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def nudge(self, names) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name in names:
                    param.add_(0.05)

    def close(self) -> None:
        self.manager.close()
        self.sender.finalize()
        self.rollout.shutdown()


def greedy(rollout):
    return [c.token_ids for c in rollout.generate(PROMPTS, GREEDY)]


def test_only_what_changed_travels_and_the_rollout_serves_the_trainers_weights(model_dir):
    path = WeightPath(model_dir)
    try:
        first = path.manager.sync(1).sent
        assert first.skipped == 0 and first.bytes == path.total  # nothing held yet
        unchanged = path.manager.sync(2).sent
        assert unchanged.bytes == 0 and unchanged.skipped == first.num_tensors
        names = [n for n, _ in path.model.named_parameters()]
        trained = names[: len(names) // 2]  # the other half frozen
        path.nudge(trained)
        half = path.manager.sync(3).sent
        assert set(half.fingerprints) == set(trained)
        assert 0 < half.bytes < path.total and half.bytes + half.skipped_bytes == path.total
        reference = WeightPath(model_dir, delta=False)  # the same weights, sent whole
        try:
            reference.nudge(trained)
            reference.manager.sync(1)
            assert greedy(path.rollout) == greedy(reference.rollout)
        finally:
            reference.close()
    finally:
        path.close()


def test_a_lost_bucket_fails_the_same_sync_naming_the_tensor(model_dir, monkeypatch):
    path = WeightPath(model_dir)
    try:
        path.manager.sync(1)
        path.nudge([n for n, _ in path.model.named_parameters()])
        # the receiver takes every bucket and reports the stream whole, but the second
        # bucket's bytes never land in the rollout's weights
        add_bucket, copy_bytes, seen = buckets.Reassembler.add_bucket, buckets.copy_bytes, []
        here = threading.local()

        def lossy_copy(targets, sources):
            if not getattr(here, "lose", False):
                copy_bytes(targets, sources)

        def lose_the_second(self, layout):
            seen.append(layout.pieces)
            here.lose = len(seen) == 2
            try:
                return add_bucket(self, layout)
            finally:
                here.lose = False

        monkeypatch.setattr(buckets, "copy_bytes", lossy_copy)
        monkeypatch.setattr(buckets.Reassembler, "add_bucket", lose_the_second)
        with pytest.raises(WeightSyncError) as failure:
            path.manager.sync(2)
        first_lost = next(p.name for p in seen[1] if p.first and p.last)
        message = str(failure.value)
        assert "rollout 0 does not serve weights version 2" in message
        assert repr(first_lost) in message and "\n" not in message
        monkeypatch.undo()
        # the failed version is not trusted: the next sync sends everything, and it holds
        again = path.manager.sync(3).sent
        assert again.skipped == 0 and again.bytes == path.total
    finally:
        path.close()


def test_provenance_off_checks_nothing_though_delta_keeps_fingerprints(model_dir, monkeypatch):
    """weight_sync.provenance=false with delta on (which keeps fingerprints for itself): a
    rollout that serves its weights in another form (a bf16 rollout of an fp32 trainer reports
    other fingerprints) is not checked, where provenance on refuses it."""
    for provenance in (True, False):
        path = WeightPath(model_dir, provenance=provenance)
        other = lambda expected: {name: "float32:crc32:0" for name in expected}  # noqa: E731
        monkeypatch.setattr(path.rollout, "weights_fingerprint", other)
        try:
            if provenance:
                with pytest.raises(WeightSyncError, match="does not serve weights version 1"):
                    path.manager.sync(1)
            else:
                assert path.manager.sync(1).sent.bytes == path.total
        finally:
            path.close()
