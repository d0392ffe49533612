"""A rollout that is alive but silent (SIGSTOP: the process exists, answers nothing) fails
the run within ``rollout.stall_timeout_s``, in one line naming it, and ``--resume auto``
continues. The drill before: no word and no progress for the 90 s of the stop, and with
``rollout.request_timeout_s=30`` a poller traceback blaming exit code -9, our own kill."""

from __future__ import annotations

import re
import signal
import sys

import psutil
import pytest

from rl_support import kill_mid_run, make_rl_job, metrics_rows, run_rl
from sft_support import sft_env

pytestmark = [pytest.mark.fault, pytest.mark.timeout(600)]

SERVER = "drivetrain.rollout.process.server"
STALL_S = 5


def only(pids: list[int]) -> int:
    assert len(pids) == 1, pids
    return pids[0]


def check_stall_line(stderr: str, elapsed: float, names: str) -> None:
    assert "Traceback" not in stderr, stderr[-3000:]
    line = stderr.strip().splitlines()[-1]
    print(line)
    assert line.startswith("error: ") and names in line, line
    assert f"rollout.stall_timeout_s={STALL_S}" in line or "rollout.stall_timeout_s" in line
    assert "exit code" not in line, line
    # the deadline, the stall noticed at the next poll, the run's own wind-down; the deadline
    # is the longest the line names (a call in flight may have a longer one than the ping's:
    # "did not answer weights_receive for 10 s nor a ping for 5 s")
    deadline = max(int(s) for s in re.findall(r"for (\d+) s", line))
    assert STALL_S <= elapsed < deadline + 15, f"{elapsed:.1f} s: {line}"


@pytest.mark.serial  # a rollout server and the trainer busy together; a 15 s bound
def test_a_stopped_rollout_process_fails_the_run_in_one_line_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    args = [*make_rl_job(tmp_path), f"run.output_dir={out}", "run.steps=30", "run.save_every=1",
            "algorithm.mode=async", f"rollout.python={sys.executable}",
            f"rollout.stall_timeout_s={STALL_S}"]  # fmt: skip

    def rollout_server(run: int) -> int:
        children = psutil.Process(run).children(recursive=True)
        return only([p.pid for p in children if SERVER in " ".join(p.cmdline())])

    elapsed, stderr = kill_mid_run(args, out, sft_env(tmp_path), rollout_server, signal.SIGSTOP)
    print(f"the run failed {elapsed:.1f} s after the rollout process was stopped")
    check_stall_line(stderr, elapsed, "rollout process (pid")
    assert "was silent for" in stderr.strip().splitlines()[-1]
    summary, done = run_rl("grpo", *args, "--resume", "auto", env=sft_env(tmp_path))
    assert "resumed from" in done.stderr and summary["steps"] == 30
    steps = [r["step"] for r in metrics_rows(out) if "reward/mean" in r]
    assert steps[-1] == 30


def _rollout_actor() -> int:
    return only(
        [p.pid for p in psutil.process_iter(["cmdline"])
         if " ".join(p.info["cmdline"] or []).startswith("ray::RolloutActor")]
    )  # fmt: skip


@pytest.mark.slow  # Ray: a cluster start, two ranks and a rollout actor
@pytest.mark.serial
def test_a_stopped_ray_rollout_actor_fails_the_run_in_one_line(tmp_path):
    out = tmp_path / "run"
    args = [*make_rl_job(tmp_path), f"run.output_dir={out}", "run.steps=30", "run.save_every=1",
            "workers.num=2", "placement.mode=separate", "algorithm.mode=async",
            f"rollout.stall_timeout_s={STALL_S}"]  # fmt: skip
    elapsed, stderr = kill_mid_run(
        args, out, sft_env(tmp_path), lambda run: _rollout_actor(), signal.SIGSTOP
    )
    print(f"the run failed {elapsed:.1f} s after the rollout actor was stopped")
    check_stall_line(stderr, elapsed, "the rollout actor 0 (pid")
