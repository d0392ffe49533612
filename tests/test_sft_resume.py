"""Kill an SFT run mid-way, resume it, and get the losses of a run that was never interrupted.
A checkpoint whose write was cut short is never resumed from."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sft_support import make_job, run_sft, sft_command, sft_env, train_losses

pytestmark = pytest.mark.timeout(600)

STEPS = ("run.max_steps=8", "run.save_every=2", "run.keep_last=3")


def logged_steps(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue
    return max(steps, default=0)


@pytest.mark.slow  # a killed run, its resume and a reference: 35 s
def test_killed_run_resumes_with_the_same_losses(tmp_path):
    base = make_job(tmp_path)
    reference = (
        train_losses(tmp_path / "reference")
        if run_sft(tmp_path, tmp_path / "reference", *base, *STEPS)
        else {}
    )

    out = tmp_path / "killed"
    cmd = sft_command(f"run.output_dir={out}", *base, *STEPS)
    proc = subprocess.Popen(
        cmd, env=sft_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 240
    while logged_steps(out) < 5:  # past the step-4 checkpoint, before the end
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    ckpts = out / "checkpoints"
    complete = sorted(p.name for p in ckpts.glob("step_*"))
    assert complete and "step_00000008" not in complete
    # What a save killed mid-write leaves behind: a staging directory with engine files.
    torn = ckpts / ".step_00000010.partial" / "engine"
    torn.mkdir(parents=True)
    (torn / "__0_0.distcp").write_bytes(b"half a shard")

    resumed = run_sft(tmp_path, out, *base, *STEPS, "--resume", "auto")
    assert resumed["steps"] == 8
    assert not torn.parent.exists()
    losses = train_losses(out)
    assert list(losses) == list(range(1, 9))
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, abs=1e-6), (step, reference, losses)


@pytest.mark.slow  # 38 s
def test_resume_from_an_explicit_checkpoint_and_bad_paths(tmp_path):
    base = make_job(tmp_path)
    out = tmp_path / "run"
    run_sft(tmp_path, out, *base, "run.max_steps=4", "run.save_every=2")
    reference = train_losses(out)
    again = tmp_path / "again"
    step2 = out / "checkpoints" / "step_00000002"
    run_sft(tmp_path, again, *base, "run.max_steps=4", "--resume", str(step2))
    assert train_losses(again) == {
        3: pytest.approx(reference[3], abs=1e-6),
        4: pytest.approx(reference[4], abs=1e-6),
    }
    cmd = sft_command(f"run.output_dir={tmp_path / 'x'}", *base, "--resume", str(tmp_path / "nope"))
    done = subprocess.run(cmd, env=sft_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "not a complete drivetrain checkpoint" in done.stderr
