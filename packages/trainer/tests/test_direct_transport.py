"""The in-process ``direct`` transport: the export's own objects reach every rollout with no
copy, each still valid while it is applied; failures on either side end the sync in time."""

from __future__ import annotations

import pytest

from drivetrain.api import Prompt, SamplingParams, WeightSyncConfig
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.runtime.weight_receiver import WeightReceiver
from drivetrain.testing import FakeRollout, FakeRolloutConfig, fake_model
from drivetrain.trainer.rl.sync_manager import WeightSyncManager, connect_transport


def reused_buffer_export(weights):
    """Like an engine's export: every tensor is written into one buffer the next one reuses."""
    buffer: list = []
    for name, value in weights.items():
        buffer[:] = value
        yield name, buffer


def connected(n=2, **config):
    sender = ckpt_engines.load("direct")(WeightSyncConfig(**config))
    rollouts = [FakeRollout(FakeRolloutConfig(vocab_size=8)) for _ in range(n)]
    receivers = connect_transport(sender, "direct", rollouts)
    return sender, rollouts, receivers


def test_every_rollout_gets_the_export_even_from_a_reused_buffer():
    sender, rollouts, receivers = connected()
    new = fake_model.init_weights(8, seed=9, scale=0.5)
    manager = WeightSyncManager(
        lambda v, _base=None: sender.send(reused_buffer_export(new), version=v), rollouts, receivers
    )
    report = manager.sync(4)
    assert report.sent.num_tensors == len(new) and len(report.received) == 2
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    fresh = FakeRollout(FakeRolloutConfig(vocab_size=8))
    fresh.weights = new
    want = fresh.generate([Prompt(token_ids=(1,))], params)[0].token_ids
    for rollout in rollouts:
        assert rollout.weights == new and rollout.weight_version == 4
        assert rollout.generate([Prompt(token_ids=(1,))], params)[0].token_ids == want


def test_a_rollout_refusing_the_stream_fails_the_sync_and_keeps_old_weights():
    sender, rollouts, receivers = connected(timeout_s=5)
    old = [dict(r.weights) for r in rollouts]
    manager = WeightSyncManager(
        lambda v, _base=None: sender.send(iter([("nope", [0.0])]), version=v), rollouts, receivers
    )
    with pytest.raises(WeightSyncError, match="unknown weight 'nope'"):
        manager.sync(1)
    assert [r.weights for r in rollouts] == old and {r.weight_version for r in rollouts} == {0}
    # the connection still works
    new = fake_model.init_weights(8, seed=2, scale=0.5)
    manager.send = lambda v, _base=None: sender.send(iter(new.items()), version=v)
    assert manager.sync(2).version == 2 and rollouts[1].weights == new


def test_a_failing_export_aborts_every_receiver():
    sender, rollouts, receivers = connected(timeout_s=5)

    def broken():
        yield "bigram.bias", [0.0] * 8
        raise RuntimeError("export died")

    manager = WeightSyncManager(
        lambda v, _base=None: sender.send(broken(), version=v), rollouts, receivers
    )
    with pytest.raises(WeightSyncError, match="export died"):
        manager.sync(1)
    assert {r.weight_version for r in rollouts} == {0}


def test_a_channel_of_another_process_is_refused():
    with pytest.raises(WeightSyncError, match="one process only"):
        WeightReceiver(FakeRollout(FakeRolloutConfig())).connect(
            "direct", WeightSyncConfig(), rank=1, topology=None, endpoint={"channel": "x"}
        )
