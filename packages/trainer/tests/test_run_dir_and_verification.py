"""Checkpoints are resumed from only when they verify; a run never mixes with another's."""

from __future__ import annotations

import io
import shutil

import pytest
import typer
from rich.console import Console

from drivetrain.runtime.manifest import MANIFEST_FILE
from drivetrain.trainer.checkpoints import (
    RUN_ID_FILE,
    STATE_FILE,
    CheckpointManager,
    read_checkpoint,
)
from drivetrain.trainer.commands.skeleton import ending_in_one_line
from drivetrain.trainer.console import plain_console
from drivetrain.trainer.errors import CheckpointError, NothingToTrain, RunDirectoryError
from drivetrain.trainer.run_dir import (
    adopt_checkpoint,
    check_steps_left,
    claim_run_dir,
    holds_a_run,
    resume_point,
)

pytestmark = pytest.mark.fault


def save(manager, step, state=None):
    engine_dir = manager.staging(step) / "engine"
    engine_dir.mkdir(parents=True)
    (engine_dir / "weights").write_bytes(bytes([step]) * 4096)
    return manager.publish(step, state or {"engine": "e"})


def test_pruning_removes_only_this_runs_checkpoints(tmp_path):
    old = CheckpointManager(tmp_path, keep_last=2, writer=True, run_id="old")
    save(old, 9), save(old, 10)
    new = CheckpointManager(tmp_path, keep_last=2, writer=True, run_id="new")
    for step in (1, 2, 3, 4):
        save(new, step)
    kept = {(c.run_id, c.step) for c in new.complete()}
    assert kept == {("old", 9), ("old", 10), ("new", 3), ("new", 4)}


def test_auto_resume_skips_damaged_checkpoints_and_says_why(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5, writer=True)
    for step in (1, 2, 3):
        save(manager, step)
    weights = tmp_path / "step_00000003" / "engine" / "weights"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x40
    weights.write_bytes(bytes(data))
    (tmp_path / "step_00000002" / "trainer_state.json").write_text("{trunc")
    skipped = []
    found = manager.latest_verified(lambda path, why: skipped.append((path.name, why)))
    assert found.step == 1
    assert [name for name, _ in skipped] == ["step_00000003", "step_00000002"]
    assert "weights differs from what was written" in skipped[0][1]
    assert "corrupt" in skipped[1][1]
    with pytest.raises(CheckpointError, match=r"step_00000003/engine/weights differs") as err:
        resume_point(manager, str(tmp_path / "step_00000003"), overwrite=False,
                     console=plain_console())  # fmt: skip
    assert "\n" not in str(err.value)


def test_a_new_run_refuses_a_directory_holding_another_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / ".step_00000001.partial").mkdir(parents=True)
    (out / "checkpoints" / ".step_00000001.partial" / "x").write_text("torn save")
    assert not holds_a_run(out)  # staging leftovers are not a run
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirectoryError, match="--overwrite"):
        claim_run_dir(out, resuming=False, overwrite=False, writer=True, console=plain_console())
    claim_run_dir(out, resuming=True, overwrite=False, writer=True, console=plain_console())
    assert (out / "metrics.jsonl").exists()
    claim_run_dir(out, resuming=False, overwrite=True, writer=True, console=plain_console())
    assert not out.exists()
    (aside,) = tmp_path.glob("run.replaced-*")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_overwrite_with_a_checkpoint_inside_the_directory_is_refused(tmp_path):
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2, writer=True)
    path = save(manager, 1)
    with pytest.raises(CheckpointError, match="--overwrite moves"):
        resume_point(manager, str(path), overwrite=True, console=plain_console())
    assert resume_point(manager, "auto", overwrite=True, console=plain_console()) is None
    assert resume_point(manager, "auto", overwrite=False, console=plain_console()).step == 1


def test_a_run_resumed_at_or_past_its_last_step_trains_nothing(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2, writer=True)
    save(manager, 10)
    found = manager.latest()
    check_steps_left(found, 11, "run.steps")  # one step left
    for total in (10, 8):
        said = rf"nothing to train: .*step_00000010 is at step 10 and run.steps makes {total} steps"
        with pytest.raises(NothingToTrain, match=said) as err:
            check_steps_left(found, total, "run.steps")
        assert "\n" not in str(err.value)


def test_a_checkpoint_of_another_rollout_backend_is_another_run(tmp_path):
    """The SmolLM2 README's order: the hf run, then the vLLM run into the same directory."""
    manager = CheckpointManager(tmp_path, keep_last=2, writer=True)
    save(manager, 10, {"algorithm": "grpo", "rollout": "hf", "mode": "sync"})
    found = manager.latest()
    vllm = {"algorithm": "grpo", "rollout": "vllm", "mode": "sync"}
    with pytest.raises(CheckpointError, match=r"has rollout='hf', this run 'vllm'; use another"):
        adopt_checkpoint(found, vllm, manager)
    adopt_checkpoint(found, {**vllm, "rollout": "hf"}, manager)


def test_every_checkpoint_damaged_says_so_and_why(tmp_path):
    """The drill: with every checkpoint corrupt the message said the directory held 'another
    run's files' and suggested --overwrite, which would move the damaged run aside."""
    manager = CheckpointManager(tmp_path, keep_last=5, writer=True)
    for step in (1, 2):
        save(manager, step)
        weights = tmp_path / f"step_{step:08d}" / "engine" / "weights"
        weights.write_bytes(b"\0" + weights.read_bytes()[1:])
    with pytest.raises(CheckpointError) as err:
        resume_point(manager, "auto", overwrite=False, console=plain_console())
    said = str(err.value)
    assert said.startswith(
        f"every checkpoint in {tmp_path} is damaged or another run's (step_00000002: "
    )
    assert "; step_00000001: " in said and "--resume PATH" in said and "\n" not in said


def test_a_checkpoint_without_a_manifest_is_resumed_with_a_warning(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=5, writer=True)
    save(manager, 1)
    (tmp_path / "step_00000001" / MANIFEST_FILE).unlink()  # as written before manifests existed
    heard = Console(file=io.StringIO(), soft_wrap=True, markup=False, highlight=False)
    found = resume_point(manager, "auto", overwrite=False, console=heard)
    assert found.step == 1
    assert heard.file.getvalue().strip() == (
        f"warning: {found.path} has no manifest (written before drivetrain checked its files): "
        "resuming from it unverified"
    )


def test_auto_resume_skips_another_runs_step_directories(tmp_path):
    """The drill: a step directory symlinked to another run's checkpoint (another lr, another
    run id) was resumed silently, and the next checkpoints carried that run's id."""
    ours = CheckpointManager(
        tmp_path / "run" / "checkpoints", keep_last=5, writer=True, run_id="mine"
    )
    save(ours, 1), save(ours, 2)
    theirs = CheckpointManager(tmp_path / "other" / "checkpoints", keep_last=5, writer=True,
                               run_id="theirs")  # fmt: skip
    linked, copied = save(theirs, 3), save(theirs, 4)
    (ours.root / "step_00000003").symlink_to(linked)
    shutil.copytree(copied, ours.root / "step_00000004")
    heard = Console(file=io.StringIO(), soft_wrap=True, markup=False, highlight=False)
    resumed = CheckpointManager(ours.root, keep_last=5, writer=True)
    found = resume_point(resumed, "auto", overwrite=False, console=heard)
    assert found.step == 2 and resumed.run_id == "mine"
    assert heard.file.getvalue().splitlines() == [
        f"skipping checkpoint {ours.root / 'step_00000004'}: another run's (run_id theirs, this "
        "run's is mine)",
        f"skipping checkpoint {ours.root / 'step_00000003'}: a symlink to {linked.resolve()}, "
        f"outside {ours.root.parent}",
    ]
    # the next checkpoint replaces the link (not what it points to) and is this run's
    save(resumed, 3)
    assert not (ours.root / "step_00000003").is_symlink() and (linked / STATE_FILE).is_file()
    assert read_checkpoint(ours.root / "step_00000003").run_id == "mine"
    # explicitly: allowed, said in one line, and the run keeps its own run id
    explicit = CheckpointManager(ours.root, keep_last=5, writer=True)
    heard = Console(file=io.StringIO(), soft_wrap=True, markup=False, highlight=False)
    found = resume_point(explicit, str(linked), overwrite=False, console=heard)
    assert found.run_id == "theirs" and explicit.run_id == "mine"
    assert heard.file.getvalue().splitlines() == [
        f"resuming from another run's checkpoint {linked} (run_id theirs); this run keeps its "
        "own run_id mine"
    ]
    # a directory written before the run id file existed: most of its own steps say whose it is
    (ours.root / RUN_ID_FILE).unlink()
    assert CheckpointManager(ours.root, keep_last=5, writer=False).recorded_run_id() == "mine"


def test_links_within_the_run_and_runs_without_a_recorded_id_are_resumed(tmp_path):
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5, writer=True)
    save(manager, 1)
    (manager.root / "step_00000002").symlink_to(manager.root / "step_00000001")
    assert manager.outside(manager.root / "step_00000002") is None
    (manager.root / RUN_ID_FILE).unlink()
    fresh = CheckpointManager(manager.root, keep_last=5, writer=True)
    found = resume_point(fresh, "auto", overwrite=False, console=plain_console())
    assert found.path.name == "step_00000002" and fresh.run_id == manager.run_id


@pytest.mark.parametrize(("rank", "said"), [("0", True), ("1", False)])
def test_nothing_to_train_is_said_by_torchruns_first_rank_only(monkeypatch, rank, said):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", rank)
    heard = Console(file=io.StringIO(), soft_wrap=True, markup=False, highlight=False)
    with pytest.raises(typer.Exit) as ended, ending_in_one_line(heard):
        raise NothingToTrain("nothing to train: step_00000004 is at step 4")
    assert ended.value.exit_code == 0
    assert heard.file.getvalue() == (
        "nothing to train: step_00000004 is at step 4\n" if said else ""
    )
