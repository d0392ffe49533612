"""An output directory that stops taking writes ends the run in one line (issue 59); the whole
command is in tests/test_output_dir_faults.py. Root bypasses chmod, so here the failures are
raised where the writes happen."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from drivetrain.runtime.manifest import verify_manifest
from drivetrain.trainer.checkpoints import CheckpointManager
from drivetrain.trainer.errors import OutputWriteError
from drivetrain.trainer.job_config import LoggingConfig
from drivetrain.trainer.metrics import MetricsLogger, StepLog
from drivetrain.trainer.output_writes import output_writes, unwritable
from drivetrain.trainer.run_loop import Checkpointer
from drivetrain.trainer.stopping import Position

pytestmark = pytest.mark.fault

READ_ONLY = os.strerror(errno.EROFS)


def read_only(path: Path | bytes) -> OSError:
    return OSError(errno.EROFS, READ_ONLY, path)


def test_what_counts_as_the_output_directory_not_taking_writes(tmp_path):
    out = tmp_path / "run"
    assert unwritable(read_only(out / "metrics.jsonl"), out) == (
        str(out / "metrics.jsonl"),
        READ_ONLY,
    )
    events = os.fsencode(out / "tensorboard" / "events")  # TensorBoard's names are bytes
    assert unwritable(read_only(events), out) == (str(out / "tensorboard" / "events"), READ_ONLY)
    try:
        raise RuntimeError("saving failed") from OSError(errno.EDQUOT, "quota", str(out / "x"))
    except RuntimeError as chained:
        assert unwritable(chained, out) == (str(out / "x"), "quota")
    assert unwritable(read_only(tmp_path / "cache" / "x"), out) is None  # not the run's
    assert unwritable(OSError(errno.EIO, "I/O error", str(out / "x")), out) is None
    # a worker's or DCP's error quotes it: within a checkpoint save, its staging failed
    quoted = RuntimeError(f"rank 0: OSError: [Errno 30] {READ_ONLY}: '/elsewhere'")
    staging = out / "checkpoints" / ".step_00000002.partial"
    assert unwritable(quoted, out, staging) == (str(staging), READ_ONLY)
    assert unwritable(quoted, out) is None
    assert unwritable(RuntimeError("shape mismatch"), out, staging) is None


class SavesUntilReadOnly:
    """A job whose engine writes its checkpoint until the directory turns read-only."""

    spec = SimpleNamespace(state={"engine": "e"})

    def __init__(self) -> None:
        self.read_only = False

    def save(self, engine_path: str, step: int) -> None:
        Path(engine_path).mkdir(parents=True)
        if self.read_only:
            raise read_only(Path(engine_path) / "__0_0.distcp")
        (Path(engine_path) / "__0_0.distcp").write_bytes(bytes([step]) * 64)


def test_a_checkpoint_save_in_a_read_only_directory_is_one_line(tmp_path):
    checkpoints = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2, writer=True)
    position = Position(checkpoints)
    job = SavesUntilReadOnly()
    saver = Checkpointer(job, checkpoints, position)  # type: ignore[arg-type]
    position.done = 1
    saver.save(1)
    job.read_only, position.done = True, 2
    with pytest.raises(OutputWriteError) as err:
        saver.save(2)
    staging = checkpoints.staging(2)
    assert str(err.value) == (
        f"cannot write {staging / 'engine' / '__0_0.distcp'} ({READ_ONLY}) after 2 steps; "
        f"nothing is torn: the last complete checkpoint is step 1 ({checkpoints.step_path(1)}), "
        "and a partial checkpoint is never resumed from; rerun with --resume auto after fixing it"
    )
    assert not staging.exists() and position.saved == 1
    verify_manifest(checkpoints.step_path(1))
    none_yet = r"no checkpoint was written yet \(a rerun starts"
    with (
        pytest.raises(OutputWriteError, match=none_yet),
        output_writes(tmp_path / "run", Position(checkpoints, done=3)),
    ):
        raise read_only(tmp_path / "run" / "metrics.jsonl")


def test_the_metrics_file_names_itself_when_its_disk_is_full():
    with pytest.raises(OSError) as err:
        StepLog(Path("/dev/full")).write({"step": 1})
    assert err.value.errno == errno.ENOSPC and err.value.filename == "/dev/full"


def test_tensorboards_writer_thread_failing_is_raised_once_without_its_traceback(
    tmp_path, monkeypatch, capfd
):
    """The drill's first traceback was the writer thread's; the run's own came after."""
    from tensorboard.compat.tensorflow_stub.io import gfile

    logger = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True, wandb=False), run_config={})

    def refuse(self, filename, file_content, binary_mode=False):
        raise read_only(os.fsencode(filename))

    monkeypatch.setattr(gfile.LocalFileSystem, "append", refuse)
    with pytest.raises(OSError) as err:  # at a later step's log, or at the latest when closing
        try:
            for step in range(1, 4):
                logger.log(step, {"train/loss": 1.0})
        finally:
            logger.close()
    assert err.value.errno == errno.EROFS
    assert unwritable(err.value, tmp_path) is not None
    assert "Traceback" not in capfd.readouterr().err


def test_a_full_device_elsewhere_is_not_blamed_on_the_output_directory(tmp_path):
    """/dev/shm full in a worker, quoted in the error text: not the staging directory's fault."""
    from drivetrain.trainer.output_writes import unwritable

    shm = OSError(errno.ENOSPC, "No space left on device", "/dev/shm/segment")
    try:
        try:
            raise shm
        except OSError as exc:
            raise RuntimeError(f"worker 1 failed: {exc}") from exc
    except RuntimeError as wrapped:
        assert unwritable(wrapped, tmp_path, tmp_path / ".step_1.partial") is None
