"""A run owns its output directory: a second `drivetrain sft` on a live run's directory is
refused in one line and leaves the live run untouched (it used to resume the live run's newest
checkpoint and delete its half-written one, and the live run died at its next save), and two
runs started together into a fresh directory leave exactly one of them running."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sft_support import make_job, sft_command, sft_env

# two small runs at once, as the drill has it; their deadlines are loose enough to share the
# cores with another test
pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]


def start(root: Path, out: Path, *args: str) -> subprocess.Popen:
    cmd = sft_command(*make_job(root), f"run.output_dir={out}", *args)
    return subprocess.Popen(cmd, env=sft_env(root), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def steps_logged(out: Path) -> int:
    metrics = out / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    return sum("train/loss" in json.loads(line) for line in metrics.read_text().splitlines())


def test_a_second_run_on_a_live_directory_is_refused_and_the_first_lives(tmp_path):
    out = tmp_path / "twin"
    first = start(tmp_path, out, "run.max_steps=2000", "run.save_every=1")
    try:
        deadline = time.monotonic() + 120
        while steps_logged(out) < 2:
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the first run logged no two steps in 120 s"
            time.sleep(0.2)
        second = start(tmp_path, out, "run.max_steps=2000", "run.save_every=1")
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert f"is in use by another run (pid {first.pid} on" in last, err[-3000:]
        assert "Traceback" not in err
        logged = steps_logged(out)
        deadline = time.monotonic() + 60
        while steps_logged(out) < logged + 2:  # still training, saving every step
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)


def test_two_runs_started_together_leave_one_running(tmp_path):
    out = tmp_path / "fresh"
    runs = [start(tmp_path, out, "run.max_steps=30", "run.save_every=1")]
    time.sleep(0.5)
    runs.append(start(tmp_path, out, "run.max_steps=30", "run.save_every=1"))
    results = [(run.returncode, err) for run in runs for _, err in [run.communicate(timeout=240)]]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, err in results]
    refused = next(err for code, err in results if code == 2)
    assert "is in use by another run" in refused.strip().splitlines()[-1]
    states = sorted((out / "checkpoints").glob("step_*"))
    assert states and all((p / "trainer_state.json").is_file() for p in states)
    assert not list((out / "checkpoints").glob("*.partial"))
