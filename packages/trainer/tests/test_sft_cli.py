"""``drivetrain sft`` validates everything before writing anything, with errors that say what
to fix. These run with the pure-Python ``fake`` engine: validation never trains."""

import pytest
from typer.testing import CliRunner

from drivetrain.trainer.cli import app
from trainer_fixtures import write_jsonl

runner = CliRunner()


@pytest.fixture
def job(tmp_path, tiny_model):
    rows = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(12)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "out"
    base = [f"engine.model.path={tiny_model}", f"data.train_path={data}", f"run.output_dir={out}"]
    return tmp_path, out, base


def invoke(*args):
    return runner.invoke(app, ["sft", *args], env={"COLUMNS": "250"})


def fails(result, *needles):
    assert result.exit_code == 2, result.output
    for needle in needles:
        assert needle in result.output.replace("\n", " "), result.output


def test_dry_run_validates_without_writing(job):
    _, out, base = job
    result = invoke("--engine", "fake", "--dry-run", *base, "run.batch_size=4")
    assert result.exit_code == 0, result.output
    assert "12 training examples" in result.output and "3 steps of 4 sequences" in result.output
    assert not out.exists()


def test_print_config_shows_the_engine_config(job):
    _, _, base = job
    result = invoke("--engine", "fake", "--print-config", *base, "engine.vocab_size=99")
    assert result.exit_code == 0, result.output
    assert "vocab_size: 99" in result.output and "truncation: error" in result.output


def test_unknown_engine_lists_installed_engines(job):
    _, out, base = job
    fails(invoke("--engine", "nope", *base), "nope", "fake", "fsdp2")
    assert not out.exists()


def test_unknown_key_lists_valid_keys(job):
    _, out, base = job
    fails(invoke("--engine", "fake", *base, "run.max_stepz=3"), "run.max_stepz", "max_steps")
    fails(invoke("--engine", "fake", *base, "data.truncation=middle"), "error, left, right")
    assert not out.exists()


@pytest.mark.parametrize("command", ["sft", "grpo"])
def test_error_text_is_printed_verbatim(tmp_path, command):
    """Messages hold things like gloo's ``[/__w/.../pair.cc:537]``: printed as text, never parsed
    as rich markup (which raised MarkupError instead of reporting the error)."""
    missing = tmp_path / "[/__w/third_party/pair.cc:537]" / "job.yaml"
    result = runner.invoke(app, [command, "--config", str(missing)], env={"COLUMNS": "250"})
    fails(result, "error: config file", "[/__w/third_party/pair.cc:537]", "does not exist")


def test_data_errors(job):
    tmp, out, base = job
    missing = [*base, f"data.train_path={tmp / 'missing.jsonl'}"]
    fails(invoke("--engine", "fake", *missing), "missing.jsonl", "does not exist")
    corrupt = tmp / "corrupt.jsonl"
    corrupt.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    fails(invoke("--engine", "fake", *base, f"data.train_path={corrupt}"), "corrupt.jsonl:2")
    empty = tmp / "empty.jsonl"
    empty.write_text("")
    fails(invoke("--engine", "fake", *base, f"data.train_path={empty}"), "no usable example")
    fails(invoke("--engine", "fake", *base, "data.max_length=5"), "train.jsonl:1:", "max_length=5")
    fails(invoke("--engine", "fake", *base, "run.batch_size=64"), "larger than the 12")
    assert not out.exists()


def test_model_and_data_go_together(job):
    _, _, base = job
    fails(invoke("--engine", "fake", base[0]), "data.train_path is required")
    fails(invoke("--engine", "fake", base[1]), "engine.model.path is required")
