"""A run's output directory that is not all its own, or stops taking writes, as a user meets it
with `drivetrain sft` (issue 59): the real command on a tiny fsdp2 job in a subprocess.

- a ``step_*`` symlinked to another run's checkpoint (another run id) was resumed silently by
  ``--resume auto``, and the next checkpoints carried that run's id, so pruning no longer knew
  this run's own: now it is skipped, saying why, and ``--resume PATH`` to it says whose it is
  while the run keeps its own id;
- the output directory turning read-only mid-run (TensorBoard's writer thread, or the next
  checkpoint's ``.step_N.partial``) ended in a 200-400 line traceback: now one line naming the
  path and the last complete checkpoint, which ``--resume auto`` continues from.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from drivetrain.runtime.manifest import verify_manifest, write_manifest
from sft_support import (
    CHECKPOINTED_STEPS,
    make_job,
    run_sft,
    sft_again,
    sft_command,
    sft_env,
    step_dir,
)

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

STEPS = CHECKPOINTED_STEPS
sft = sft_again
FOREIGN = "0ther0run0id"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("outputs")
    base = make_job(root)
    run_sft(root, root / "run", *base, *STEPS)
    return root, base


def run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "trainer_state.json").read_text())["run_id"]


def with_foreign_step_4(trained, tmp_path) -> tuple[Path, Path]:
    """This run's directory (steps 1-3 its own) whose step_4 is a symlink to another run's."""
    root, _ = trained
    other = tmp_path / "other"
    shutil.copytree(root / "run", other)
    theirs = step_dir(other, 4)
    state = json.loads((theirs / "trainer_state.json").read_text())
    (theirs / "trainer_state.json").write_text(json.dumps({**state, "run_id": FOREIGN}))
    write_manifest(theirs)
    out = tmp_path / "run"
    shutil.copytree(root / "run", out)
    shutil.rmtree(step_dir(out, 4))
    step_dir(out, 4).symlink_to(theirs)
    return out, theirs


def test_auto_resume_skips_a_step_symlinked_to_another_run(trained, tmp_path):
    out, theirs = with_foreign_step_4(trained, tmp_path)
    own = run_id(step_dir(out, 3))
    done = sft(trained, out, "--resume", "auto")
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    assert f"skipping checkpoint {step_dir(out, 4)}: a symlink to {theirs}, outside {out}" in said
    assert f"resumed from {step_dir(out, 3)} at step 3" in said, done.stderr
    # step 4 trained again, into a directory of this run's: the link went, not its target
    assert not step_dir(out, 4).is_symlink() and run_id(step_dir(out, 4)) == own
    assert run_id(theirs) == FOREIGN
    verify_manifest(theirs)


def test_an_explicit_resume_from_another_runs_step_keeps_this_runs_id(trained, tmp_path):
    out, theirs = with_foreign_step_4(trained, tmp_path)
    own = run_id(step_dir(out, 3))
    done = sft(trained, out, "run.max_steps=5", "--resume", str(step_dir(out, 4)))
    assert done.returncode == 0, done.stderr
    assert (
        f"resuming from another run's checkpoint {step_dir(out, 4)} (run_id {FOREIGN}); this "
        f"run keeps its own run_id {own}"
    ) in done.stderr.splitlines(), done.stderr
    assert run_id(step_dir(out, 5)) == own
    # pruning (keep_last=4) knows this run's own: steps 1-3 and 5; the other run's link stays
    kept = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert kept == [f"step_{step:08d}" for step in (1, 2, 3, 4, 5)]
    assert step_dir(out, 4).is_symlink() and run_id(theirs) == FOREIGN


# The output directory, bind-mounted read-only over itself in a mount namespace of the run's
# own once a checkpoint is published: files the run holds open still take writes (the
# metrics file), new ones and reopened ones (TensorBoard reopens its event file for every
# record, a checkpoint's staging is new) fail with EROFS, as on a file system remounted
# read-only. Root bypasses chmod, so this is how the test takes writes away. The remount is
# refused (EBUSY, "mount point is busy") while the run holds a file open for writing through
# the new bind mount (one it opened between the two mounts: with a checkpoint every step it
# often does), so it is retried until it takes or the run ends.
READ_ONLY = (
    "{run} > {log}.out 2> {log}.err & pid=$!; "
    "while [ ! -d {ready} ]; do kill -0 $pid 2>/dev/null || break; sleep 0.02; done; "
    "mount --bind {out} {out} && "
    "until mount -o remount,bind,ro {out} 2>/dev/null; "
    "do kill -0 $pid 2>/dev/null || break; sleep 0.01; done; "
    "wait $pid"
)


@pytest.mark.parametrize(
    ("writer", "options", "ready", "failed"),
    [
        ("tensorboard", ("logging.tensorboard=true", "run.save_every=5"), 5,
         r"tensorboard/events\.out\.tfevents\.\S+"),
        ("staging", ("run.save_every=1",), 2, r"checkpoints/\.step_\d{8}\.partial\S*"),
    ],
)  # fmt: skip
def test_an_output_directory_turning_read_only_is_one_line(
    trained, tmp_path, writer, options, ready, failed
):
    if subprocess.run(["unshare", "--mount", "--map-root-user", "true"]).returncode:
        pytest.skip("no mount namespace here (unshare --mount --map-root-user)")
    root, base = trained
    out = tmp_path / "run"
    out.mkdir()
    run = sft_command(f"run.output_dir={out}", *base, "run.keep_last=4", "run.max_steps=400",
                      *options)  # fmt: skip
    log = tmp_path / "run-log"
    script = READ_ONLY.format(
        run=shlex.join(run), log=log, ready=step_dir(out, ready), out=shlex.quote(str(out))
    )
    done = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script],
                          env=sft_env(root), timeout=240)  # fmt: skip
    stderr = Path(f"{log}.err").read_text()
    assert done.returncode == 2, stderr
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr
    error = stderr.strip().splitlines()[-1]
    said = re.fullmatch(
        rf"error: cannot write {re.escape(str(out))}/({failed}) \(Read-only file system\) "
        r"after (\d+) steps; nothing is torn: the last complete checkpoint is step (\d+) "
        rf"\({re.escape(str(out))}/checkpoints/step_(\d{{8}})\), and a partial checkpoint is "
        r"never resumed from; rerun with --resume auto after fixing it",
        error,
    )
    assert said, error
    last = int(said[3])
    assert last >= ready and int(said[4]) == last
    verify_manifest(step_dir(out, last))
    # fixed (outside the namespace the directory takes writes): it continues from there
    done = sft(trained, out, "run.save_every=1", f"run.max_steps={last + 1}", "--resume", "auto")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {step_dir(out, last)} at step {last}" in done.stderr.splitlines()
    assert not list((out / "checkpoints").glob(".*.partial"))
