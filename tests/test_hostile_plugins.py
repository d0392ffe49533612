"""Hostile plugins cannot hang a run (the drills of issue 59): an environment whose step never
returns, a tool that never returns, a model (here its tool parser) writing 1,000 calls a turn
to tools that hang, and a 10 MB observation. The environment is ``tests/hostile_env``,
installed as a distribution of its own (its ``dist-info`` and entry points on ``PYTHONPATH``);
each run is ``drivetrain grpo env=hostile`` as a user types it.

Before: a multi-screen traceback and a process that never exited; 23,546 threads in 35 s;
20 s and 5 GB of memory per 10 MB observation.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from cli_run import run_cli
from drivetrain.trainer.builtin.tiny_model import build_tiny_chat_model
from sft_support import sft_env

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

HERE = Path(__file__).parent
JOB = (
    "env=hostile",
    "run.steps=1",
    "run.prompts_per_step=2",
    "sampling.n=2",
    "sampling.max_new_tokens=4",
    "data.val_size=2",
    "run.eval_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
    "run.export_hf=false",
)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``hostile-env`` as an installed distribution would be: its module and a dist-info
    whose entry points declare the environment and the tool parser."""
    site = tmp_path_factory.mktemp("hostile-site")
    shutil.copy(HERE / "hostile_env" / "hostile_env.py", site)
    info = site / "hostile_env-1.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hostile-env\nVersion: 1.0.0\n")
    (info / "entry_points.txt").write_text(
        "[drivetrain.environments]\nhostile = hostile_env:HOSTILE\n\n"
        "[drivetrain.tool_parsers]\nthousand = hostile_env:ThousandCalls\n"
    )
    build_tiny_chat_model(site / "model")
    return site


def grpo(site: Path, tmp_path: Path, *args: str, threads: Path | None = None):
    env = sft_env(tmp_path)
    env["PYTHONPATH"] = str(site)
    if threads is not None:
        env["HOSTILE_THREADS"] = str(threads)
    began = time.monotonic()
    done = run_cli(
        "grpo", *JOB, f"actor.model.path={site / 'model'}",
        f"run.output_dir={tmp_path / 'run'}", *args, env=env, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    return done, time.monotonic() - began


def one_line(done) -> str:
    """The error line a failed run ends with; there must be no traceback before it."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("mode", ["hang_step", "hang_tool"])
def test_a_step_that_never_returns_fails_in_one_line_and_the_process_exits(
    installed, tmp_path, mode
):
    done, took = grpo(
        installed, tmp_path, f"episode.options.mode={mode}", "episode.step_timeout_s=3"
    )
    line = one_line(done)
    assert "environment HostileEnvironment did not answer episode" in line, line
    assert "within 3 s (episode.step_timeout_s)" in line, line
    assert took < 120, f"the run took {took:.0f} s to fail"  # it used to never exit


def test_a_thousand_calls_to_hanging_tools_cost_bounded_threads(installed, tmp_path):
    threads = tmp_path / "threads.txt"
    done, took = grpo(
        installed, tmp_path, "episode.options.mode=many_calls", "episode.tool_parser=thousand",
        "episode.max_turns=8", threads=threads,
    )  # fmt: skip
    line = one_line(done)
    assert "all 64 tool slots are held by calls that never returned" in line, line
    assert "environment HostileEnvironment in episode" in line, line
    counts = [int(n) for n in threads.read_text().split()]
    print(f"threads peaked at {max(counts)}; failed {took:.1f} s after the start: {line}")
    # the 64 slots filled with hung tools, and no more: the trainer's own threads besides
    # (was 23,546 in 35 s)
    assert 64 <= max(counts) < 64 + 40, counts
    assert took < 120


def test_a_10_mb_observation_is_cut_before_tokenising(installed, tmp_path):
    done, took = grpo(
        installed, tmp_path, "episode.options.mode=big_observation", "episode.max_turns=3"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "episode/turns_mean" in r)
    # every episode went on past its first step with a cut observation (16,000 characters kept)
    assert step["episode/cut/observation_chars"] >= 10_000_000 - 16_000, step
    assert took < 120, f"{took:.0f} s"  # was ~20 s and 5 GB per episode


def test_an_environment_raising_outside_its_episodes_is_one_line(installed, tmp_path):
    done, _ = grpo(installed, tmp_path, "episode.options.mode=broken_tasks")
    line = one_line(done)
    assert line == (
        "error: env=hostile: its tasks('train') raised RuntimeError: the task server is down"
    ), line
