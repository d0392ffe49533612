"""A huge data row costs memory in proportion to its bytes, never to its tokenisation (issue 19,
item 9: one 50 MB JSONL line took > 8 GB before it was rejected).

The commands run in a fresh interpreter: a dry run on small data first (every import and model
load a run needs), then each run with the huge row; its peak RSS (``getrusage``) minus the RSS
when it started is what the row cost. The fast check of the same bound is in test_data.py.
"""

import json
import subprocess
import sys

import pytest

from trainer_fixtures import write_jsonl

pytestmark = pytest.mark.fault

BIG_CHARS = 50_000_000
#: the row's bytes are held about three times (the line, its text, the parsed row): measured
#: 143-149 MB
MAX_GROWTH_MB = 512

PROBE = """
import json, resource, sys, time
from typer.testing import CliRunner
from drivetrain.trainer.cli import app

def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

runner = CliRunner()
warm_args, runs = json.loads(sys.argv[1])
warm = runner.invoke(app, warm_args)
assert warm.exit_code == 0, warm.output
for args in runs:
    base = rss_mb()  # now, not the peak so far: what an earlier peak hid counts as growth
    start = time.perf_counter()
    result = runner.invoke(app, args)
    print(json.dumps({"rc": result.exit_code, "output": result.output,
                      "seconds": time.perf_counter() - start, "growth_mb": peak_mb() - base}))
"""


def probe(warm: list[str], runs: list[list[str]], tmp_path) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps([warm, runs])],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


@pytest.mark.slow  # ~20 s: a fresh interpreter imports torch and transformers
@pytest.mark.timeout(300)
def test_a_50_mb_line_is_refused_or_cut_in_bounded_memory(tmp_path, tiny_model):
    small = [{"prompt": f"{i}+1=", "response": str(i + 1), "answer": str(i + 1)} for i in range(8)]
    huge = {"prompt": "1" * BIG_CHARS, "response": "2", "answer": "2"}
    small_file = write_jsonl(tmp_path / "small.jsonl", small)
    big_file = write_jsonl(tmp_path / "big.jsonl", [*small[:4], huge, *small[4:]])
    sft = ["sft", "--engine", "fake", "--dry-run", f"engine.model.path={tiny_model}",
           "run.batch_size=4", f"run.output_dir={tmp_path / 'out'}"]  # fmt: skip
    grpo = ["grpo", "--engine", "fake", "--rollout", "fake", "--dry-run",
            f"actor.model.path={tiny_model}", "run.prompts_per_step=4",
            f"run.output_dir={tmp_path / 'out'}"]  # fmt: skip
    refused, cut, dropped = probe(
        [*sft, f"data.train_path={small_file}"],
        [
            [*sft, f"data.train_path={big_file}"],
            [*sft, f"data.train_path={big_file}", "data.truncation=left"],
            [*grpo, f"data.train_path={big_file}"],
        ],
        tmp_path,
    )
    assert refused["rc"] == 2 and len(errors(refused["output"])) == 1, refused
    assert f"{big_file}:5: {BIG_CHARS + 1:,} characters cannot fit" in refused["output"]
    assert cut["rc"] == 0 and "9 training examples" in cut["output"], cut
    assert dropped["rc"] == 0 and "8 prompts (1 too long)" in dropped["output"], dropped
    for run in (refused, cut, dropped):
        assert run["seconds"] < 30, run
        assert run["growth_mb"] < MAX_GROWTH_MB, run
