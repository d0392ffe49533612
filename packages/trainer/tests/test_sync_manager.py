"""The weight-sync sequence with the pure-Python engine, rollout and transport: weights and
version arrive, the phases run in order (KV cache released around the transfer when asked),
generation resumes even after a failure, and a rollout a failed sync left with a mix of
weights refuses to generate until the next sync lands."""

from __future__ import annotations

import pytest

from drivetrain.api import Prompt, SamplingParams
from drivetrain.api.registry import ckpt_engines
from drivetrain.api.weight_sync import WeightSyncError
from drivetrain.runtime.weight_receiver import WeightReceiver
from drivetrain.testing import FakeEngine, FakeEngineConfig, FakeRollout, FakeRolloutConfig
from drivetrain.testing.fake_transport import FakeTransportConfig
from drivetrain.trainer.rl.sync_manager import WeightSyncManager, connect_transport, engine_sender


class RecordingRollout(FakeRollout):
    def __init__(self, config, log):
        super().__init__(config)
        self.log = log

    def pause_generation(self, *, abort=False):
        self.log.append(("pause", abort))
        return 2 if abort else 0

    def resume_generation(self):
        self.log.append(("resume",))

    def sleep(self, level=1):
        self.log.append(("sleep", level))
        return super().sleep(level)

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tuple(tags) if tags else None))
        super().wake_up(tags)

    def update_weights(self, weights, *, version):
        self.log.append(("update", version))
        super().update_weights(weights, version=version)


def setup(log, n=2, **config):
    engine = FakeEngine(FakeEngineConfig(vocab_size=8, seed=3))
    engine.initialize()
    rollouts = [RecordingRollout(FakeRolloutConfig(vocab_size=8), log) for _ in range(n)]
    sender = ckpt_engines.load("fake")(FakeTransportConfig(**config))
    receivers = connect_transport(sender, "fake", rollouts)
    return engine, rollouts, sender, receivers


def greedy(rollout):
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    return [c.token_ids for c in rollout.generate([Prompt(token_ids=(2,))], params)]


def test_an_update_moves_weights_and_version_in_order():
    log = []
    engine, rollouts, sender, receivers = setup(log)
    manager = WeightSyncManager(
        engine_sender(engine.export_weights, sender), rollouts, receivers, colocated=True
    )
    with manager.updating(7):
        log.append(("train",))
    (report,) = manager.reports
    fresh = FakeRollout(FakeRolloutConfig(vocab_size=8, seed=3))
    for rollout in rollouts:
        assert rollout.weight_version == 7
        assert greedy(rollout) == greedy(fresh)
    assert report.version == 7 and len(report.received) == 2
    assert all(r.digest == report.sent.digest for r in report.received)
    assert set(report.phases) == {"pause", "transfer", "resume"}
    assert report.metrics()["weight_sync/version"] == 7.0
    per_rollout = [entry for entry in log if entry != ("update", 7)]
    assert per_rollout == [
        ("sleep", 1), ("sleep", 1),
        ("train",),
        ("wake_up", ("weights",)), ("wake_up", ("weights",)),
        ("pause", False), ("pause", False),
        ("resume",), ("resume",),
        ("wake_up", ("kv_cache",)), ("wake_up", ("kv_cache",)),
    ]  # fmt: skip
    assert log.count(("update", 7)) == 2


def test_a_failed_update_wakes_the_rollouts_and_sends_nothing():
    log = []
    engine, rollouts, sender, receivers = setup(log)
    manager = WeightSyncManager(
        engine_sender(engine.export_weights, sender), rollouts, receivers, colocated=True
    )
    with pytest.raises(FloatingPointError), manager.updating(3):
        raise FloatingPointError("loss is nan")
    assert log == [("sleep", 1)] * 2 + [("wake_up", None)] * 2
    assert manager.reports == [] and all(r.weight_version == 0 for r in rollouts)


def test_a_failed_sync_resumes_generation_and_torn_rollouts_refuse_until_the_next():
    log = []
    engine, rollouts, sender, receivers = setup(log, fail_after=1, timeout_s=5)
    manager = WeightSyncManager(
        engine_sender(engine.export_weights, sender), rollouts, receivers, abort_inflight=True
    )
    with pytest.raises(WeightSyncError, match="fake failure after 1 tensors"):
        manager.sync(1)
    assert all(r.weight_version == 0 for r in rollouts)
    assert log[-2:] == [("resume",), ("resume",)]
    assert ("pause", True) in log
    for rollout in rollouts:  # one tensor of version 1 arrived before the failure
        with pytest.raises(RuntimeError, match="update to weights version 1 failed part-way"):
            greedy(rollout)
    sender.config = FakeTransportConfig(timeout_s=5)
    manager.sync(2)
    assert all(r.weight_version == 2 and greedy(r) for r in rollouts)


def test_non_sending_ranks_drain_the_export():
    engine = FakeEngine(FakeEngineConfig(vocab_size=8, seed=3))
    engine.initialize()
    assert engine_sender(engine.export_weights, None)(1) is None


def test_receive_before_connect_is_an_error():
    with pytest.raises(WeightSyncError, match="receive before connect"):
        WeightReceiver(FakeRollout(FakeRolloutConfig())).receive(1)


def test_a_receiver_that_cannot_join_fails_at_once_with_its_own_cause():
    """A rollout whose environment lacks the transport: its one-line cause, at once, not the
    sender's 'only 0 of 1 receivers connected' after the sender's deadline."""
    import threading
    import time

    from drivetrain.api.errors import PluginError
    from drivetrain.trainer.rl.sync_manager import connect_rollouts

    never = threading.Event()

    def sender(topology, endpoint):  # waits for receivers that will never come
        never.wait(60)
        raise AssertionError("only 0 of 1 receivers connected")

    began = time.monotonic()
    with pytest.raises(PluginError, match="no_such_transport"):
        connect_rollouts(sender, {}, "no_such_transport", None, [FakeRollout(FakeRolloutConfig())])
    assert time.monotonic() - began < 5
    never.set()
