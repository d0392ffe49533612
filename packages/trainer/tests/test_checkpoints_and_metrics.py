import json

from drivetrain.trainer.checkpoints import CheckpointManager
from drivetrain.trainer.job_config import LoggingConfig
from drivetrain.trainer.metrics import LOSS_CURVE, METRICS_FILE, MetricsLogger


def fake_save(manager, step):
    """What the engine does on every rank: write into the staging directory."""
    engine_dir = manager.staging(step) / "engine"
    engine_dir.mkdir(parents=True)
    (engine_dir / "weights").write_text(str(step))
    return manager.publish(step, {"engine": "e"})


def test_only_published_checkpoints_count_and_old_ones_are_pruned(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, writer=True)
    for step in (2, 4, 6):
        fake_save(manager, step)
    assert [c.step for c in manager.complete()] == [4, 6]
    # A save killed mid-write leaves its staging directory; a stray step_* without state is
    # not ours either. Neither is ever resumed from, and staging leftovers are cleaned up.
    (manager.staging(8) / "engine").mkdir(parents=True)
    (tmp_path / "step_00000010").mkdir()
    assert manager.latest().step == 6
    assert manager.clean_staging() == [manager.staging(8)]
    assert not manager.staging(8).exists()


def test_non_writers_do_not_touch_files(tmp_path):
    writer = CheckpointManager(tmp_path, keep_last=1, writer=True)
    fake_save(writer, 2)
    reader = CheckpointManager(tmp_path, keep_last=1, writer=False)
    (reader.staging(4) / "engine").mkdir(parents=True)
    assert reader.publish(4, {}) is None and reader.clean_staging() == []
    assert reader.latest().step == 2


def test_resumed_metrics_drop_steps_after_the_checkpoint(tmp_path):
    config = LoggingConfig(tensorboard=True, wandb=False)
    logger = MetricsLogger(tmp_path, config, run_config={})
    for step in range(1, 6):
        logger.log(step, {"train/loss": 1.0 / step})
    logger.close()
    logger = MetricsLogger(tmp_path, config, run_config={}, resume_step=3)
    logger.log(4, {"train/loss": 0.3, "val/loss": 0.4})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / METRICS_FILE).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["train/loss"] == 0.3
    assert any((tmp_path / "tensorboard").iterdir())
    png = LOSS_CURVE.plot(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
